//! vLLM's Prometheus metrics, rendered by hand in text format 0.0.4 exactly as
//! prometheus_client writes them (HELP/TYPE lines, sorted labels, `_total` on counters,
//! `_created` gauges in V1, Go-style float formatting).
//!
//! V0 and V1 expose mostly the same families in the same order; [`FlavorNames`] holds the names
//! and help texts that differ, and `render` adds the families only one generation has.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::config::{MetricsFlavor, SpecDecode};
use crate::engine::EngineSnapshot;
use crate::text::Finish;

const V1_TTFT: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
const V1_ITL: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
const V1_E2E: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];
const V0_TTFT: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
];
const V0_TPOT: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
];
const V0_E2E: &[f64] = &[1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0];

#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    bucket_counts: Vec<AtomicU64>,
    count: AtomicU64,
    sum_bits: AtomicU64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            bucket_counts: (0..bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            count: AtomicU64::new(0),
            sum_bits: AtomicU64::new(0f64.to_bits()),
        }
    }

    pub fn observe(&self, value: f64) {
        if let Some(bucket) = self.bounds.iter().position(|bound| value <= *bound) {
            if let Some(counter) = self.bucket_counts.get(bucket) {
                counter.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        let _ = self
            .sum_bits
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                Some((f64::from_bits(bits) + value).to_bits())
            });
    }
}

#[derive(Debug)]
pub struct Metrics {
    flavor: MetricsFlavor,
    model_name: String,
    block_size: u32,
    num_gpu_blocks: u32,
    speculative: Option<SpecDecode>,
    created: f64,
    pub prompt_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    /// `vllm:request_success_total` by finished_reason, in [`FINISHED_REASONS`] order.
    finished: [AtomicU64; 3],
    pub oom: AtomicU64,
    spec_drafts: AtomicU64,
    spec_draft_tokens: AtomicU64,
    spec_accepted: AtomicU64,
    /// Time to first token.
    pub ttft: Histogram,
    /// Inter-token latency (V0: time per output token).
    pub itl: Histogram,
    /// End-to-end request latency.
    pub e2e: Histogram,
}

const FINISHED_REASONS: [&str; 3] = ["stop", "length", "abort"];

/// How a request ended, for `vllm:request_success_total{finished_reason}`.
#[derive(Clone, Copy, Debug)]
pub enum Ended {
    Finished(Finish),
    Abort,
}

/// The names and help texts that differ between vLLM generations.
struct FlavorNames {
    running_help: &'static str,
    kv_usage: &'static str,
    kv_usage_help: &'static str,
    inter_token: &'static str,
    inter_token_help: &'static str,
    e2e_help: &'static str,
}

impl FlavorNames {
    fn of(flavor: MetricsFlavor) -> Self {
        match flavor {
            MetricsFlavor::V1 => FlavorNames {
                running_help: "Number of requests in model execution batches.",
                kv_usage: "vllm:kv_cache_usage_perc",
                kv_usage_help: "KV-cache usage. 1 means 100 percent usage.",
                inter_token: "vllm:inter_token_latency_seconds",
                inter_token_help: "Histogram of inter-token latency in seconds.",
                e2e_help: "Histogram of e2e request latency in seconds.",
            },
            MetricsFlavor::V0 => FlavorNames {
                running_help: "Number of requests currently running on GPU.",
                kv_usage: "vllm:gpu_cache_usage_perc",
                kv_usage_help: "GPU KV-cache usage. 1 means 100 percent usage.",
                inter_token: "vllm:time_per_output_token_seconds",
                inter_token_help: "Histogram of time per output token in seconds.",
                e2e_help: "Histogram of end to end request latency in seconds.",
            },
        }
    }
}

/// The speculative-decoding counters, read once per render.
struct SpecCounts {
    drafts: f64,
    draft_tokens: f64,
    accepted: f64,
}

impl Metrics {
    pub fn new(
        flavor: MetricsFlavor,
        model_name: String,
        block_size: u32,
        num_gpu_blocks: u32,
        speculative: Option<SpecDecode>,
    ) -> Self {
        let (ttft, itl, e2e) = match flavor {
            MetricsFlavor::V1 => (V1_TTFT, V1_ITL, V1_E2E),
            MetricsFlavor::V0 => (V0_TTFT, V0_TPOT, V0_E2E),
        };
        let created = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|since_epoch| since_epoch.as_secs_f64())
            .unwrap_or(0.0);
        Metrics {
            flavor,
            model_name,
            block_size,
            num_gpu_blocks,
            speculative,
            created,
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            finished: Default::default(),
            oom: AtomicU64::new(0),
            spec_drafts: AtomicU64::new(0),
            spec_draft_tokens: AtomicU64::new(0),
            spec_accepted: AtomicU64::new(0),
            ttft: Histogram::new(ttft),
            itl: Histogram::new(itl),
            e2e: Histogram::new(e2e),
        }
    }

    /// A request ended after generating `generated` tokens.
    pub fn ended(&self, how: Ended, generated: u64) {
        let reason = match how {
            Ended::Finished(Finish::Stop) => &self.finished[0],
            Ended::Finished(Finish::Length) => &self.finished[1],
            Ended::Abort => &self.finished[2],
        };
        reason.fetch_add(1, Ordering::Relaxed);
        if let Some(spec) = &self.speculative {
            // Each step proposes k draft tokens; accepted ones plus the bonus token are emitted.
            let per_draft = u64::from(spec.num_speculative_tokens.max(1));
            let rate = spec.acceptance_rate.clamp(0.0, 1.0);
            let tokens_per_step = 1.0 + per_draft as f64 * rate;
            let drafts = (generated as f64 / tokens_per_step).ceil() as u64;
            let draft_tokens = drafts * per_draft;
            let accepted = ((draft_tokens as f64) * rate).round() as u64;
            self.spec_drafts.fetch_add(drafts, Ordering::Relaxed);
            self.spec_draft_tokens
                .fetch_add(draft_tokens, Ordering::Relaxed);
            self.spec_accepted.fetch_add(accepted, Ordering::Relaxed);
        }
    }

    /// The whole exposition, families in the order vLLM registers them.
    pub fn render(&self, engine: &EngineSnapshot) -> String {
        let v1 = self.flavor == MetricsFlavor::V1;
        let names = FlavorNames::of(self.flavor);
        let spec = self.speculative.as_ref().map(|_| SpecCounts {
            drafts: load(&self.spec_drafts),
            draft_tokens: load(&self.spec_draft_tokens),
            accepted: load(&self.spec_accepted),
        });
        let mut out = Renderer::new(v1, &self.model_name, self.created);
        if let (true, Some(spec)) = (v1, &spec) {
            render_spec_counters_v1(&mut out, spec);
        }
        render_scheduler(&mut out, &names, engine);
        if let (false, Some(spec)) = (v1, &spec) {
            self.render_spec_gauges_v0(&mut out, spec);
        }
        out.counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            engine.preemptions as f64,
        );
        self.render_token_counters(&mut out);
        if let (false, Some(spec)) = (v1, &spec) {
            render_spec_counters_v0(&mut out, spec);
        }
        self.render_finished(&mut out);
        self.render_latencies(&mut out, &names);
        out.counter(
            "sim_oom",
            "Requests failed with a simulated CUDA out-of-memory error.",
            load(&self.oom),
        );
        self.render_cache_info(&mut out);
        out.text
    }

    fn render_token_counters(&self, out: &mut Renderer) {
        out.counter(
            "vllm:prompt_tokens",
            "Number of prefill tokens processed.",
            load(&self.prompt_tokens),
        );
        out.counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            load(&self.generation_tokens),
        );
    }

    fn render_spec_gauges_v0(&self, out: &mut Renderer, spec: &SpecCounts) {
        let rate = if spec.draft_tokens > 0.0 {
            spec.accepted / spec.draft_tokens
        } else {
            0.0
        };
        out.gauge(
            "vllm:spec_decode_draft_acceptance_rate",
            "Speulative token acceptance rate.",
            rate,
        );
        let per_draft = self.speculative.as_ref().map_or(1.0, |config| {
            f64::from(config.num_speculative_tokens.max(1))
        });
        let emitted = spec.accepted + spec.drafts;
        let efficiency = if spec.drafts > 0.0 {
            emitted / (spec.drafts * (per_draft + 1.0))
        } else {
            0.0
        };
        out.gauge(
            "vllm:spec_decode_efficiency",
            "Speculative decoding system efficiency.",
            efficiency,
        );
    }

    fn render_finished(&self, out: &mut Renderer) {
        let name = "vllm:request_success";
        let help = "Count of successfully processed requests.";
        let total = format!("{name}_total");
        out.header(&total, help, "counter");
        for (reason, counter) in FINISHED_REASONS.iter().zip(&self.finished) {
            let labels = out.labels(&[("finished_reason", reason)]);
            out.sample(&total, &labels, load(counter));
        }
        if out.v1 {
            let created = format!("{name}_created");
            out.header(&created, help, "gauge");
            for reason in FINISHED_REASONS {
                let labels = out.labels(&[("finished_reason", reason)]);
                out.sample(&created, &labels, out.created);
            }
        }
    }

    fn render_latencies(&self, out: &mut Renderer, names: &FlavorNames) {
        out.histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            &self.ttft,
        );
        out.histogram(names.inter_token, names.inter_token_help, &self.itl);
        out.histogram(
            "vllm:e2e_request_latency_seconds",
            names.e2e_help,
            &self.e2e,
        );
    }

    fn render_cache_info(&self, out: &mut Renderer) {
        let block_size = self.block_size;
        let num_gpu_blocks = self.num_gpu_blocks;
        // The label sets differ: V1 has `engine`, and the two print their defaults differently.
        let (help, labels) = if out.v1 {
            (
                "Information of the LLMEngine CacheConfig",
                format!("block_size=\"{block_size}\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",engine=\"0\",gpu_memory_utilization=\"0.9\",num_cpu_blocks=\"None\",num_gpu_blocks=\"{num_gpu_blocks}\",swap_space=\"4.0\""),
            )
        } else {
            (
                "information of cache_config",
                format!("block_size=\"{block_size}\",cache_dtype=\"auto\",enable_prefix_caching=\"False\",gpu_memory_utilization=\"0.9\",num_cpu_blocks=\"2048\",num_gpu_blocks=\"{num_gpu_blocks}\",swap_space=\"4\""),
            )
        };
        out.header("vllm:cache_config_info", help, "gauge");
        out.sample("vllm:cache_config_info", &labels, 1.0);
    }
}

/// Running and waiting requests and the KV-cache usage (V0 adds its swap and CPU families).
fn render_scheduler(out: &mut Renderer, names: &FlavorNames, engine: &EngineSnapshot) {
    out.gauge(
        "vllm:num_requests_running",
        names.running_help,
        f64::from(engine.running),
    );
    if !out.v1 {
        out.gauge(
            "vllm:num_requests_swapped",
            "Number of requests swapped to CPU.",
            0.0,
        );
    }
    out.gauge(
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        f64::from(engine.waiting),
    );
    out.gauge(names.kv_usage, names.kv_usage_help, engine.kv_usage());
    if !out.v1 {
        out.gauge(
            "vllm:cpu_cache_usage_perc",
            "CPU KV-cache usage. 1 means 100 percent usage.",
            0.0,
        );
    }
}

fn render_spec_counters_v1(out: &mut Renderer, spec: &SpecCounts) {
    out.counter(
        "vllm:spec_decode_num_drafts",
        "Number of spec decoding drafts.",
        spec.drafts,
    );
    out.counter(
        "vllm:spec_decode_num_draft_tokens",
        "Number of draft tokens.",
        spec.draft_tokens,
    );
    out.counter(
        "vllm:spec_decode_num_accepted_tokens",
        "Number of accepted tokens.",
        spec.accepted,
    );
}

fn render_spec_counters_v0(out: &mut Renderer, spec: &SpecCounts) {
    out.counter(
        "vllm:spec_decode_num_accepted_tokens",
        "Number of accepted tokens.",
        spec.accepted,
    );
    out.counter(
        "vllm:spec_decode_num_draft_tokens",
        "Number of draft tokens.",
        spec.draft_tokens,
    );
    out.counter(
        "vllm:spec_decode_num_emitted_tokens",
        "Number of emitted tokens.",
        spec.accepted + spec.drafts,
    );
}

fn load(counter: &AtomicU64) -> f64 {
    counter.load(Ordering::Relaxed) as f64
}

/// Writes families in prometheus_client's format, with the instance's labels.
struct Renderer {
    text: String,
    v1: bool,
    model: String,
    created: f64,
}

impl Renderer {
    fn new(v1: bool, model_name: &str, created: f64) -> Self {
        Renderer {
            text: String::with_capacity(16 * 1024),
            v1,
            model: escape(model_name),
            created,
        }
    }

    fn header(&mut self, name: &str, help: &str, kind: &str) {
        let _ = writeln!(self.text, "# HELP {name} {help}");
        let _ = writeln!(self.text, "# TYPE {name} {kind}");
    }

    /// The instance labels plus `extra`, sorted by name like the fixtures.
    fn labels(&self, extra: &[(&str, &str)]) -> String {
        let mut all: Vec<(&str, &str)> = vec![("model_name", self.model.as_str())];
        if self.v1 {
            all.push(("engine", "0"));
        }
        all.extend_from_slice(extra);
        all.sort_by(|left, right| left.0.cmp(right.0));
        let pairs: Vec<String> = all
            .iter()
            .map(|(label, value)| format!("{label}=\"{value}\""))
            .collect();
        pairs.join(",")
    }

    fn sample(&mut self, name: &str, labels: &str, value: f64) {
        let _ = writeln!(self.text, "{name}{{{labels}}} {}", go_float(value));
    }

    fn gauge(&mut self, name: &str, help: &str, value: f64) {
        self.header(name, help, "gauge");
        let labels = self.labels(&[]);
        self.sample(name, &labels, value);
    }

    fn counter(&mut self, base: &str, help: &str, value: f64) {
        let total = format!("{base}_total");
        self.header(&total, help, "counter");
        let labels = self.labels(&[]);
        self.sample(&total, &labels, value);
        self.created_family(base, help);
    }

    fn created_family(&mut self, base: &str, help: &str) {
        if self.v1 {
            let created = format!("{base}_created");
            self.header(&created, help, "gauge");
            let labels = self.labels(&[]);
            let timestamp = self.created;
            self.sample(&created, &labels, timestamp);
        }
    }

    fn histogram(&mut self, name: &str, help: &str, histogram: &Histogram) {
        self.header(name, help, "histogram");
        let bucket = format!("{name}_bucket");
        let mut cumulative = 0u64;
        for (bound, counter) in histogram.bounds.iter().zip(&histogram.bucket_counts) {
            cumulative += counter.load(Ordering::Relaxed);
            let labels = self.labels(&[("le", &go_float(*bound))]);
            self.sample(&bucket, &labels, cumulative as f64);
        }
        let count = histogram.count.load(Ordering::Relaxed);
        let labels = self.labels(&[("le", "+Inf")]);
        self.sample(&bucket, &labels, count as f64);
        let labels = self.labels(&[]);
        self.sample(&format!("{name}_count"), &labels, count as f64);
        let sum = f64::from_bits(histogram.sum_bits.load(Ordering::Relaxed));
        self.sample(&format!("{name}_sum"), &labels, sum);
        self.created_family(name, help);
    }
}

fn escape(label_value: &str) -> String {
    label_value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// prometheus_client's floatToGoString: Python repr, with an exponent once there are more
/// than 6 digits before the point (2412903.0 -> 2.412903e+06).
pub fn go_float(value: f64) -> String {
    if value.is_nan() {
        return "NaN".into();
    }
    if value == f64::INFINITY {
        return "+Inf".into();
    }
    if value == f64::NEG_INFINITY {
        return "-Inf".into();
    }
    let repr = if value.fract() == 0.0 && value.abs() < 1e16 {
        format!("{value:.1}")
    } else {
        format!("{value:?}")
    };
    if value > 0.0 && !repr.contains('e') {
        if let Some((whole, fraction)) = repr.split_once('.') {
            // ASCII digits only, so splitting off the first character is safe.
            let (first, rest) = whole.split_at(1.min(whole.len()));
            if whole.len() > 6 {
                let mantissa = format!("{first}.{rest}{fraction}");
                let mantissa = mantissa.trim_end_matches('0').trim_end_matches('.');
                return format!("{mantissa}e+0{}", whole.len() - 1);
            }
        }
    }
    repr
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_float_matches_prometheus_client() {
        assert_eq!(go_float(48.0), "48.0");
        assert_eq!(go_float(0.2346), "0.2346");
        assert_eq!(go_float(2412903.0), "2.412903e+06");
        assert_eq!(go_float(1048576.0), "1.048576e+06");
        assert_eq!(go_float(9134512.0), "9.134512e+06");
        assert_eq!(go_float(0.0), "0.0");
        assert_eq!(go_float(802114.0), "802114.0");
    }
}
