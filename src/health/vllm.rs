//! What Sluice reads from a vLLM `/metrics` page: KV-cache usage, queue lengths, the size of
//! the KV cache, the speculative-decoding counters, the LoRA adapters in use, and the engine's
//! own account of where its requests' time went (its queue and prefill histograms).
//!
//! Both engine generations are read: V1 names its usage gauge `vllm:kv_cache_usage_perc` and
//! labels every series with `model_name` and `engine`; V0 names it `vllm:gpu_cache_usage_perc`
//! and has no `engine` label. A V1 server runs one engine per data-parallel rank, but Sluice
//! routes to the server, so counts are summed over engines and the usage, a fraction, is
//! averaged over them, weighted by each engine's number of blocks when all are known.
//!
//! NaN values are treated as absent, so a page without any of these names reads as all `None`,
//! which the caller takes as "no data".

use super::exposition::Sample;
use sluice_sdk::health::{EnginePhases, LoraSlots};

const KV_USAGE_V1: &str = "vllm:kv_cache_usage_perc";
const KV_USAGE_V0: &str = "vllm:gpu_cache_usage_perc";
const RUNNING: &str = "vllm:num_requests_running";
const WAITING: &str = "vllm:num_requests_waiting";
/// A gauge set to 1 whose labels are the engine's cache config, all as strings (`"None"` for
/// unset ones).
const CACHE_CONFIG: &str = "vllm:cache_config_info";
/// Every prompt token the engine scheduled is a query; those its prefix cache served are hits.
/// The difference is what it computed, and stored as blocks, which it then publishes as KV
/// events: the subscriber's liveness check compares the two.
const PREFIX_QUERIES: &str = "vllm:prefix_cache_queries_total";
const PREFIX_HITS: &str = "vllm:prefix_cache_hits_total";
const SPEC_ACCEPTED: &str = "vllm:spec_decode_num_accepted_tokens_total";
const SPEC_DRAFT: &str = "vllm:spec_decode_num_draft_tokens_total";
/// vLLM V1's per-request phase histograms, read as their sums and counts: the time from a
/// request's arrival at the engine to the step that first schedules it (its queue), from
/// then to its first token (its prefill, shared with the steps' other work as the engine
/// shares it), and the prompt tokens it computed there (its prefix cache's hits left out).
const QUEUE_SECONDS: &str = "vllm:request_queue_time_seconds_sum";
const QUEUED: &str = "vllm:request_queue_time_seconds_count";
const PREFILL_SECONDS: &str = "vllm:request_prefill_time_seconds_sum";
const PREFILLED: &str = "vllm:request_prefill_time_seconds_count";
const PREFILL_COMPUTED: &str = "vllm:request_prefill_kv_computed_tokens_sum";
const ENGINE_LABEL: &str = "engine";
/// With `--enable-lora`: a gauge whose labels are `max_lora` and the adapters with requests
/// in the engine (comma-joined), its value the time the label set was last set. Every label
/// set seen stays on the page, so the newest sample is the present.
const LORA_INFO: &str = "vllm:lora_requests_info";

/// The vLLM engine generation, told by the name of its KV-usage gauge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Generation {
    V0,
    V1,
}

/// Speculative-decoding counters since the server started, summed over engines.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SpecCounters {
    pub accepted_tokens: f64,
    pub draft_tokens: f64,
}

/// The engine's phase histograms since it started, summed over engines (see
/// [`phase_rates`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PhaseCounters {
    pub queue_seconds: f64,
    pub queued: f64,
    pub prefill_seconds: f64,
    pub prefilled: f64,
    pub computed_tokens: f64,
}

/// One scrape, read. Each field is `None` when the page does not have it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct VllmMetrics {
    /// V1 if `vllm:kv_cache_usage_perc` is on the page, else V0 if `vllm:gpu_cache_usage_perc`.
    pub generation: Option<Generation>,
    /// KV-cache usage, 0..=1.
    pub kv_usage: Option<f64>,
    /// Requests in the running batches.
    pub running: Option<f64>,
    /// Requests queued for admission.
    pub waiting: Option<f64>,
    /// Tokens per KV-cache block.
    pub block_size: Option<u32>,
    /// KV-cache blocks on the GPUs, summed over engines.
    pub num_gpu_blocks: Option<u32>,
    /// Present only when the server decodes speculatively.
    pub spec: Option<SpecCounters>,
    /// Prompt tokens computed (not served by the prefix cache) since the server started,
    /// summed over engines.
    pub computed_prompt_tokens: Option<f64>,
    /// Present only when the server serves LoRA adapters (and has run a step since it
    /// started: vLLM sets the gauge at each step).
    pub lora: Option<LoraSlots>,
    /// Present when the page has every phase histogram (vLLM V1).
    pub phases: Option<PhaseCounters>,
}

impl VllmMetrics {
    /// Free KV-cache tokens, when usage, block size and block count are known.
    pub fn free_kv_tokens(&self) -> Option<u64> {
        let usage = self.kv_usage?;
        let block_size = self.block_size?;
        let blocks = self.num_gpu_blocks?;
        // vLLM computes the usage from whole blocks, so rounding recovers the free block count.
        let free_blocks = ((1.0 - usage.clamp(0.0, 1.0)) * f64::from(blocks)).round();
        // `as` saturates (and maps NaN to 0); the value is within 0..=blocks anyway.
        Some((free_blocks as u64).saturating_mul(u64::from(block_size)))
    }
}

/// Whether [`read`] uses the series `name`: a page reader keeps only those.
pub fn wanted(name: &str) -> bool {
    WANTED.contains(&name)
}

/// The names of the samples a scrape reads.
const WANTED: [&str; 15] = [
    KV_USAGE_V1,
    KV_USAGE_V0,
    RUNNING,
    WAITING,
    CACHE_CONFIG,
    SPEC_ACCEPTED,
    SPEC_DRAFT,
    PREFIX_QUERIES,
    PREFIX_HITS,
    LORA_INFO,
    QUEUE_SECONDS,
    QUEUED,
    PREFILL_SECONDS,
    PREFILLED,
    PREFILL_COMPUTED,
];

/// Whether the family `family` may hold a sample a scrape reads: one named `family` or
/// `family_…` (a histogram's `_sum`, a counter's `_total`). The others' samples are passed
/// over unread (see `exposition::read_page`).
pub fn wanted_family(family: &str) -> bool {
    WANTED.iter().any(|name| {
        name.strip_prefix(family)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('_'))
    })
}

/// Reads the series Sluice uses from the samples of one scrape.
pub fn read(samples: &[Sample<'_>]) -> VllmMetrics {
    let mut v1_usage = EngineUsages::default();
    let mut v0_usage = EngineUsages::default();
    let mut running = None;
    let mut waiting = None;
    let mut accepted = None;
    let mut drafted = None;
    let mut queried = None;
    let mut hits = None;
    let mut block_size = None;
    let mut engine_blocks: Vec<(Option<&str>, u32)> = Vec::new();
    let mut lora: Option<&Sample<'_>> = None;
    let mut phases = [None; 5];

    for sample in samples {
        match sample.name {
            KV_USAGE_V1 => v1_usage.add(sample),
            KV_USAGE_V0 => v0_usage.add(sample),
            RUNNING => add(&mut running, sample.value),
            WAITING => add(&mut waiting, sample.value),
            SPEC_ACCEPTED => add(&mut accepted, sample.value),
            SPEC_DRAFT => add(&mut drafted, sample.value),
            PREFIX_QUERIES => add(&mut queried, sample.value),
            PREFIX_HITS => add(&mut hits, sample.value),
            QUEUE_SECONDS => add(&mut phases[0], sample.value),
            QUEUED => add(&mut phases[1], sample.value),
            PREFILL_SECONDS => add(&mut phases[2], sample.value),
            PREFILLED => add(&mut phases[3], sample.value),
            PREFILL_COMPUTED => add(&mut phases[4], sample.value),
            LORA_INFO
                if !sample.value.is_nan()
                    && lora.is_none_or(|newest| sample.value > newest.value) =>
            {
                lora = Some(sample);
            }
            CACHE_CONFIG => {
                if block_size.is_none() {
                    block_size = sample.label("block_size").and_then(parse_count);
                }
                if let Some(blocks) = sample.label("num_gpu_blocks").and_then(parse_count) {
                    engine_blocks.push((sample.label(ENGINE_LABEL), blocks));
                }
            }
            _ => {}
        }
    }

    let generation = if v1_usage.seen {
        Some(Generation::V1)
    } else if v0_usage.seen {
        Some(Generation::V0)
    } else {
        None
    };
    // A V1 server may also publish the deprecated V0 name (with the same value): V1 wins.
    let kv_usage = v1_usage
        .mean(&engine_blocks)
        .or_else(|| v0_usage.mean(&engine_blocks));
    let spec = accepted
        .zip(drafted)
        .map(|(accepted_tokens, draft_tokens)| SpecCounters {
            accepted_tokens,
            draft_tokens,
        });
    VllmMetrics {
        generation,
        kv_usage,
        running,
        waiting,
        block_size,
        num_gpu_blocks: total_blocks(&engine_blocks),
        spec,
        computed_prompt_tokens: queried.map(|q| (q - hits.unwrap_or(0.0)).max(0.0)),
        lora: lora.map(lora_slots),
        phases: phase_counters(phases),
    }
}

/// The KV-cache blocks of every engine the page names (`None` when it names none, or on
/// overflow).
fn total_blocks(engine_blocks: &[(Option<&str>, u32)]) -> Option<u32> {
    if engine_blocks.is_empty() {
        return None;
    }
    engine_blocks
        .iter()
        .try_fold(0u32, |total, (_, blocks)| total.checked_add(*blocks))
}

/// The engine's phase counters, when the page had all five (`QUEUE_SECONDS`, `QUEUED`,
/// `PREFILL_SECONDS`, `PREFILLED`, `PREFILL_COMPUTED`, in that order).
fn phase_counters(phases: [Option<f64>; 5]) -> Option<PhaseCounters> {
    let [Some(queue_seconds), Some(queued), Some(prefill_seconds), Some(prefilled), Some(computed_tokens)] =
        phases
    else {
        return None;
    };
    Some(PhaseCounters {
        queue_seconds,
        queued,
        prefill_seconds,
        prefilled,
        computed_tokens,
    })
}

/// The adapters a `vllm:lora_requests_info` sample names: vLLM 0.32 lists every adapter with
/// a request, running or waiting, under both labels; a later one may tell them apart.
fn lora_slots(sample: &Sample<'_>) -> LoraSlots {
    let mut active: Vec<String> = Vec::new();
    for label in ["running_lora_adapters", "waiting_lora_adapters"] {
        for name in sample.label(label).unwrap_or("").split(',') {
            if !name.is_empty() && !active.iter().any(|a| a == name) {
                active.push(name.to_string());
            }
        }
    }
    LoraSlots {
        max_loras: sample.label("max_lora").and_then(parse_count).unwrap_or(1),
        active,
    }
}

/// Acceptance rate over the interval between two scrapes: Δaccepted / Δdraft. None when no
/// draft tokens were proposed in between, or a counter went backwards (a restart).
pub fn acceptance_rate(previous: SpecCounters, current: SpecCounters) -> Option<f64> {
    let accepted = current.accepted_tokens - previous.accepted_tokens;
    let drafted = current.draft_tokens - previous.draft_tokens;
    // Comparisons with NaN are false, so a NaN counter gives None as well.
    if accepted >= 0.0 && drafted > 0.0 {
        // vLLM bumps the two counters one after the other, and a scrape can fall in between.
        Some((accepted / drafted).min(1.0))
    } else {
        None
    }
}

/// What the engine's phase histograms say of the requests that finished between two scrapes:
/// their mean queue time and the speed of their prefill. `None` when none finished in
/// between or a counter went backwards (a restart).
pub fn phase_rates(previous: PhaseCounters, current: PhaseCounters) -> Option<EnginePhases> {
    let queued = current.queued - previous.queued;
    let prefilled = current.prefilled - previous.prefilled;
    let queue_seconds = current.queue_seconds - previous.queue_seconds;
    let prefill_seconds = current.prefill_seconds - previous.prefill_seconds;
    let computed_tokens = current.computed_tokens - previous.computed_tokens;
    // Comparisons with NaN are false, so a NaN counter gives None as well.
    let moved_on = queued >= 1.0
        && prefilled >= 1.0
        && queue_seconds >= 0.0
        && prefill_seconds >= 0.0
        && computed_tokens >= 0.0;
    moved_on.then(|| EnginePhases {
        requests: prefilled,
        queue_seconds: queue_seconds / queued,
        prefill_seconds,
        computed_tokens,
    })
}

/// The KV-usage gauge's series of one generation, one per engine.
#[derive(Default)]
struct EngineUsages<'a> {
    seen: bool,
    /// (`engine` label, usage clamped to 0..=1); NaN values left out.
    usages: Vec<(Option<&'a str>, f64)>,
}

impl<'a> EngineUsages<'a> {
    fn add(&mut self, sample: &'a Sample<'_>) {
        self.seen = true;
        if !sample.value.is_nan() {
            self.usages
                .push((sample.label(ENGINE_LABEL), sample.value.clamp(0.0, 1.0)));
        }
    }

    /// The mean over engines, weighted by their block counts when every engine's is known
    /// (an engine with more blocks holds more of the cache), else plain.
    fn mean(&self, engine_blocks: &[(Option<&str>, u32)]) -> Option<f64> {
        match self.usages.as_slice() {
            [] => return None,
            // Exactly as published: the weighted mean of one would round.
            [(_, usage)] => return Some(*usage),
            _ => {}
        }
        let mut sum = 0.0;
        let mut weighted_sum = 0.0;
        let mut total_weight = 0.0;
        let mut all_weights_known = true;
        for (engine, usage) in &self.usages {
            sum += usage;
            match engine_blocks.iter().find(|(known, _)| known == engine) {
                Some((_, blocks)) => {
                    weighted_sum += usage * f64::from(*blocks);
                    total_weight += f64::from(*blocks);
                }
                None => all_weights_known = false,
            }
        }
        let mean = if all_weights_known && total_weight > 0.0 {
            weighted_sum / total_weight
        } else {
            sum / self.usages.len() as f64
        };
        Some(mean.clamp(0.0, 1.0))
    }
}

/// Adds a sample to a sum over engines; a NaN is treated as absent.
fn add(total: &mut Option<f64>, value: f64) {
    if !value.is_nan() {
        *total = Some(total.unwrap_or(0.0) + value);
    }
}

/// A count from a cache-config label: `"16"`, `"27526"`; `"None"` and the like are absent.
fn parse_count(label_value: &str) -> Option<u32> {
    label_value.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::super::exposition::parse;
    use super::*;

    const V0: &str = include_str!("../../tests/fixtures/vllm-v0-metrics.txt");
    const V1: &str = include_str!("../../tests/fixtures/vllm-v1-metrics.txt");

    fn read_text(text: &str) -> VllmMetrics {
        match parse(text) {
            Ok(samples) => read(&samples),
            Err(error) => panic!("{text:?} should parse: {error}"),
        }
    }

    fn assert_close(actual: Option<f64>, expected: f64) {
        match actual {
            Some(actual) => assert!((actual - expected).abs() < 1e-12, "{actual} != {expected}"),
            None => panic!("None != {expected}"),
        }
    }

    #[test]
    fn v1_fixture() {
        let metrics = read_text(V1);
        assert_eq!(
            metrics,
            VllmMetrics {
                generation: Some(Generation::V1),
                kv_usage: Some(0.2346),
                running: Some(48.0),
                waiting: Some(0.0),
                block_size: Some(16),
                num_gpu_blocks: Some(27526),
                spec: Some(SpecCounters {
                    accepted_tokens: 150_567.0,
                    draft_tokens: 540_000.0,
                }),
                // 2,431,520 prompt tokens queried, 921,344 of them served by the cache.
                computed_prompt_tokens: Some(1_510_176.0),
                // Its two label sets: the newer names the adapter in use.
                lora: Some(LoraSlots {
                    max_loras: 1,
                    active: vec!["sql-lora".into()],
                }),
                // This capture has no phase histograms.
                phases: None,
            }
        );
        // (1 - 0.2346) × 27526 = 21068.4 free blocks of 16 tokens.
        assert_eq!(metrics.free_kv_tokens(), Some(21_068 * 16));
    }

    #[test]
    fn v0_fixture() {
        let metrics = read_text(V0);
        assert_eq!(
            metrics,
            VllmMetrics {
                generation: Some(Generation::V0),
                kv_usage: Some(0.8712),
                running: Some(37.0),
                waiting: Some(4.0),
                block_size: Some(16),
                num_gpu_blocks: Some(9271),
                spec: Some(SpecCounters {
                    accepted_tokens: 802_114.0,
                    draft_tokens: 1_909_800.0,
                }),
                computed_prompt_tokens: None,
                lora: None,
                phases: None,
            }
        );
        // (1 - 0.8712) × 9271 = 1194.1 free blocks of 16 tokens.
        assert_eq!(metrics.free_kv_tokens(), Some(1194 * 16));
    }

    #[test]
    fn lora_use_is_the_newest_label_set() {
        // As vLLM 0.32 leaves them: every label set seen, its value the time it was set.
        let page = "\
vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"sql,poet\",waiting_lora_adapters=\"sql,poet\"} 1.7957518674795063e+09
vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"\",waiting_lora_adapters=\"\"} 1.795751867484648e+09
vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"poet\",waiting_lora_adapters=\"poet\"} 1.7957518600000000e+09
";
        assert_eq!(
            read_text(page).lora,
            Some(LoraSlots {
                max_loras: 2,
                active: vec![],
            })
        );
        let busy = page.replace("1.7957518674795063e+09", "1.7957519e+09");
        let slots = read_text(&busy).lora.unwrap();
        assert_eq!(slots.active, ["sql", "poet"]);
        assert!(slots.runs("poet") && !slots.has_free_slot());
        // A page of a server without LoRA has none.
        assert_eq!(read_text("vllm:num_requests_running 1\n").lora, None);
    }

    const TWO_ENGINES: &str = "\
vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3.0
vllm:num_requests_running{engine=\"1\",model_name=\"m\"} 5.0
vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 1.0
vllm:num_requests_waiting{engine=\"1\",model_name=\"m\"} 2.0
vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.5
vllm:kv_cache_usage_perc{engine=\"1\",model_name=\"m\"} 0.1
vllm:spec_decode_num_draft_tokens_total{engine=\"0\",model_name=\"m\"} 300.0
vllm:spec_decode_num_draft_tokens_total{engine=\"1\",model_name=\"m\"} 100.0
vllm:spec_decode_num_accepted_tokens_total{engine=\"0\",model_name=\"m\"} 120.0
vllm:spec_decode_num_accepted_tokens_total{engine=\"1\",model_name=\"m\"} 30.0
vllm:cache_config_info{block_size=\"16\",engine=\"0\",num_cpu_blocks=\"None\",num_gpu_blocks=\"1000\"} 1.0
vllm:cache_config_info{block_size=\"16\",engine=\"1\",num_cpu_blocks=\"None\",num_gpu_blocks=\"3000\"} 1.0
";

    #[test]
    fn engines_are_summed_and_usage_is_block_weighted() {
        let metrics = read_text(TWO_ENGINES);
        assert_eq!(metrics.generation, Some(Generation::V1));
        assert_eq!(metrics.running, Some(8.0));
        assert_eq!(metrics.waiting, Some(3.0));
        assert_eq!(metrics.num_gpu_blocks, Some(4000));
        assert_eq!(metrics.block_size, Some(16));
        assert_eq!(
            metrics.spec,
            Some(SpecCounters {
                accepted_tokens: 150.0,
                draft_tokens: 400.0,
            })
        );
        // (0.5 × 1000 + 0.1 × 3000) / 4000, where the plain mean would be 0.3.
        assert_close(metrics.kv_usage, 0.2);
        // 500 + 2700 free blocks.
        assert_eq!(metrics.free_kv_tokens(), Some(3200 * 16));
    }

    #[test]
    fn usage_is_a_plain_mean_when_an_engine_block_count_is_unknown() {
        let text = TWO_ENGINES.replace("num_gpu_blocks=\"3000\"", "num_gpu_blocks=\"None\"");
        let metrics = read_text(&text);
        assert_close(metrics.kv_usage, 0.3);
        assert_eq!(metrics.num_gpu_blocks, Some(1000));
        assert_eq!(metrics.block_size, Some(16));
    }

    #[test]
    fn v1_is_preferred_when_both_generations_are_present() {
        let text = "vllm:gpu_cache_usage_perc{model_name=\"m\"} 0.9\n\
                    vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.4\n";
        let metrics = read_text(text);
        assert_eq!(metrics.generation, Some(Generation::V1));
        assert_eq!(metrics.kv_usage, Some(0.4));
    }

    #[test]
    fn nan_values_are_absent_and_usage_is_clamped() {
        let metrics = read_text(
            "vllm:kv_cache_usage_perc{engine=\"0\"} NaN\n\
             vllm:num_requests_running{engine=\"0\"} NaN\n\
             vllm:num_requests_waiting{engine=\"0\"} NaN\n\
             vllm:num_requests_waiting{engine=\"1\"} 2\n",
        );
        assert_eq!(metrics.generation, Some(Generation::V1));
        assert_eq!(metrics.kv_usage, None);
        assert_eq!(metrics.running, None);
        assert_eq!(metrics.waiting, Some(2.0));
        // A V1 gauge that is NaN gives way to the V0 one.
        let metrics = read_text(
            "vllm:kv_cache_usage_perc{engine=\"0\"} NaN\nvllm:gpu_cache_usage_perc 0.25\n",
        );
        assert_eq!(metrics.kv_usage, Some(0.25));

        assert_eq!(
            read_text("vllm:kv_cache_usage_perc 1.2\n").kv_usage,
            Some(1.0)
        );
        assert_eq!(
            read_text("vllm:kv_cache_usage_perc -0.1\n").kv_usage,
            Some(0.0)
        );
        assert_eq!(
            read_text("vllm:kv_cache_usage_perc +Inf\n").kv_usage,
            Some(1.0)
        );
    }

    #[test]
    fn the_series_read_are_the_series_wanted() {
        for text in [V0, V1] {
            let samples = parse(text).unwrap();
            let wanted: Vec<_> = samples.iter().filter(|s| wanted(s.name)).cloned().collect();
            assert!(
                wanted.len() < samples.len() / 4,
                "a page keeps a few series"
            );
            assert_eq!(read(&wanted), read(&samples));
        }
    }

    #[test]
    fn a_page_without_vllm_metrics_reads_as_nothing() {
        let text = "process_open_fds 142.0\npython_info{major=\"3\"} 1.0\n";
        assert_eq!(read_text(text), VllmMetrics::default());
        assert_eq!(read_text(""), VllmMetrics::default());
        assert_eq!(VllmMetrics::default().free_kv_tokens(), None);
    }

    #[test]
    fn unparsable_cache_config_values_are_ignored() {
        let metrics = read_text(
            "vllm:cache_config_info{block_size=\"None\",num_gpu_blocks=\"27526.0\"} 1.0\n",
        );
        assert_eq!(metrics.block_size, None);
        assert_eq!(metrics.num_gpu_blocks, None);
    }

    #[test]
    fn spec_needs_both_counters() {
        let metrics = read_text("vllm:spec_decode_num_draft_tokens_total 10\n");
        assert_eq!(metrics.spec, None);
    }

    fn counters(accepted_tokens: f64, draft_tokens: f64) -> SpecCounters {
        SpecCounters {
            accepted_tokens,
            draft_tokens,
        }
    }

    /// Passing over the families nobody reads changes nothing read, on every page captured.
    #[test]
    fn passing_over_unread_families_reads_the_same_samples() {
        let pages = [
            V0,
            V1,
            include_str!("../../tests/fixtures/vllm-0.32/metrics-idle.http"),
            include_str!("../../tests/fixtures/vllm-0.32/metrics-after.http"),
            include_str!("../../tests/fixtures/vllm-0.32/metrics-target-lora-enabled.http"),
        ];
        for capture in pages {
            let body = capture
                .split_once("\r\n\r\n")
                .map_or(capture, |(_, body)| body)
                .as_bytes();
            let limits = crate::health::exposition::Limits::default();
            let passing =
                crate::health::exposition::read_page(body, &limits, wanted, wanted_family).unwrap();
            let naming =
                crate::health::exposition::read_page(body, &limits, wanted, |_| true).unwrap();
            assert!(!passing.samples.is_empty());
            assert_eq!(passing.samples, naming.samples);
            assert_eq!(passing.sample_lines, naming.sample_lines);
            assert_eq!(passing.skipped, naming.skipped);
        }
        assert!(wanted_family("vllm:request_queue_time_seconds"));
        assert!(wanted_family("vllm:prefix_cache_queries"));
        assert!(wanted_family(KV_USAGE_V1));
        assert!(!wanted_family("vllm:e2e_request_latency_seconds"));
        assert!(!wanted_family("vllm:time_to_first_token_seconds"));
    }

    #[test]
    fn a_real_vllm_0_32_page_gives_its_phase_histograms_and_their_interval() {
        /// The exposition of a captured `/metrics` answer (after its blank line).
        fn page(capture: &str) -> VllmMetrics {
            let body = capture
                .split_once("\r\n\r\n")
                .or_else(|| capture.split_once("\n\n"));
            read_text(body.map_or(capture, |(_, body)| body))
        }
        let idle = page(include_str!(
            "../../tests/fixtures/vllm-0.32/metrics-idle.http"
        ));
        let after = page(include_str!(
            "../../tests/fixtures/vllm-0.32/metrics-after.http"
        ));
        assert_eq!(idle.phases, Some(PhaseCounters::default()));
        let counters = after.phases.unwrap();
        assert_eq!((counters.queued, counters.prefilled), (31.0, 31.0));
        assert_eq!(counters.computed_tokens, 650.0);
        let phases = phase_rates(idle.phases.unwrap(), counters).unwrap();
        assert_eq!(phases.requests, 31.0);
        assert!((phases.queue_seconds - 0.005_051_365 / 31.0).abs() < 1e-9);
        assert!((phases.prefill_seconds - 15.988_733_922).abs() < 1e-6);
        // 21 computed tokens a request, in half a second each (a CPU engine's tiny prompts):
        // too few to tell a speed from the step they took.
        assert_eq!(phases.prefill_speed(), None);
        // Nothing finished in between, or a restart: no interval.
        assert_eq!(phase_rates(counters, counters), None);
        assert_eq!(phase_rates(counters, PhaseCounters::default()), None);
    }

    #[test]
    fn acceptance_rate_over_an_interval() {
        // 150 of 300 drafted since the previous scrape, whatever came before.
        let rate = acceptance_rate(counters(1000.0, 4000.0), counters(1150.0, 4300.0));
        assert_eq!(rate, Some(0.5));
        assert_eq!(
            acceptance_rate(counters(0.0, 0.0), counters(0.0, 10.0)),
            Some(0.0)
        );
        // Accepted counted before drafted, a scrape in between.
        assert_eq!(
            acceptance_rate(counters(0.0, 0.0), counters(12.0, 10.0)),
            Some(1.0)
        );
    }

    #[test]
    fn acceptance_rate_without_drafts_or_after_a_restart() {
        let previous = counters(1000.0, 4000.0);
        assert_eq!(acceptance_rate(previous, previous), None);
        assert_eq!(acceptance_rate(previous, counters(1000.0, 4000.0)), None);
        // A restart: both counters back near zero.
        assert_eq!(acceptance_rate(previous, counters(10.0, 30.0)), None);
        // Only one went backwards.
        assert_eq!(acceptance_rate(previous, counters(900.0, 4100.0)), None);
        assert_eq!(acceptance_rate(previous, counters(1100.0, 3900.0)), None);
        assert_eq!(acceptance_rate(previous, counters(f64::NAN, 4100.0)), None);
    }

    #[test]
    fn free_kv_tokens_needs_usage_block_size_and_count() {
        let full = VllmMetrics {
            kv_usage: Some(0.25),
            block_size: Some(16),
            num_gpu_blocks: Some(1000),
            ..VllmMetrics::default()
        };
        assert_eq!(full.free_kv_tokens(), Some(750 * 16));
        assert_eq!(
            VllmMetrics {
                kv_usage: Some(1.0),
                ..full.clone()
            }
            .free_kv_tokens(),
            Some(0)
        );
        for partial in [
            VllmMetrics {
                kv_usage: None,
                ..full.clone()
            },
            VllmMetrics {
                block_size: None,
                ..full.clone()
            },
            VllmMetrics {
                num_gpu_blocks: None,
                ..full.clone()
            },
        ] {
            assert_eq!(partial.free_kv_tokens(), None);
        }
    }
}
