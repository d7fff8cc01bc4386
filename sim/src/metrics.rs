//! vLLM's Prometheus metrics, rendered by hand in text format 0.0.4 exactly as
//! prometheus_client writes them (HELP/TYPE lines, sorted labels, `_total` on counters,
//! `_created` gauges in V1, Go-style float formatting).

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
    counts: Vec<AtomicU64>,
    count: AtomicU64,
    sum_bits: AtomicU64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: (0..bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            count: AtomicU64::new(0),
            sum_bits: AtomicU64::new(0f64.to_bits()),
        }
    }

    pub fn observe(&self, v: f64) {
        if let Some(i) = self.bounds.iter().position(|b| v <= *b) {
            if let Some(c) = self.counts.get(i) {
                c.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        let _ = self
            .sum_bits
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| {
                Some((f64::from_bits(b) + v).to_bits())
            });
    }
}

#[derive(Debug)]
pub struct Metrics {
    flavor: MetricsFlavor,
    model_name: String,
    block_size: u32,
    num_gpu_blocks: u32,
    spec: Option<SpecDecode>,
    created: f64,
    pub prompt_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    success: [AtomicU64; 3],
    pub oom: AtomicU64,
    spec_drafts: AtomicU64,
    spec_draft_tokens: AtomicU64,
    spec_accepted: AtomicU64,
    pub ttft: Histogram,
    pub itl: Histogram,
    pub e2e: Histogram,
}

/// How a request ended, for `vllm:request_success_total{finished_reason}`.
#[derive(Clone, Copy, Debug)]
pub enum Ended {
    Finished(Finish),
    Abort,
}

impl Metrics {
    pub fn new(
        flavor: MetricsFlavor,
        model_name: String,
        block_size: u32,
        num_gpu_blocks: u32,
        spec: Option<SpecDecode>,
    ) -> Self {
        let (ttft, itl, e2e) = match flavor {
            MetricsFlavor::V1 => (V1_TTFT, V1_ITL, V1_E2E),
            MetricsFlavor::V0 => (V0_TTFT, V0_TPOT, V0_E2E),
        };
        let created = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        Metrics {
            flavor,
            model_name,
            block_size,
            num_gpu_blocks,
            spec,
            created,
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            success: [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)],
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
        let i = match how {
            Ended::Finished(Finish::Stop) => 0,
            Ended::Finished(Finish::Length) => 1,
            Ended::Abort => 2,
        };
        self.success[i].fetch_add(1, Ordering::Relaxed);
        if let Some(spec) = &self.spec {
            // Each step proposes k draft tokens; accepted ones plus the bonus token are emitted.
            let k = u64::from(spec.num_speculative_tokens.max(1));
            let rate = spec.acceptance_rate.clamp(0.0, 1.0);
            let per_step = 1.0 + k as f64 * rate;
            let drafts = (generated as f64 / per_step).ceil() as u64;
            let draft_tokens = drafts * k;
            let accepted = ((draft_tokens as f64) * rate).round() as u64;
            self.spec_drafts.fetch_add(drafts, Ordering::Relaxed);
            self.spec_draft_tokens
                .fetch_add(draft_tokens, Ordering::Relaxed);
            self.spec_accepted.fetch_add(accepted, Ordering::Relaxed);
        }
    }

    pub fn render(&self, e: &EngineSnapshot) -> String {
        let mut out = String::with_capacity(16 * 1024);
        let r = Renderer {
            out: &mut out,
            v1: self.flavor == MetricsFlavor::V1,
            model: escape(&self.model_name),
            created: self.created,
        };
        match self.flavor {
            MetricsFlavor::V1 => self.render_v1(r, e),
            MetricsFlavor::V0 => self.render_v0(r, e),
        }
        out
    }

    fn render_v1(&self, mut r: Renderer<'_>, e: &EngineSnapshot) {
        if self.spec.is_some() {
            r.counter(
                "vllm:spec_decode_num_drafts",
                "Number of spec decoding drafts.",
                load(&self.spec_drafts),
            );
            r.counter(
                "vllm:spec_decode_num_draft_tokens",
                "Number of draft tokens.",
                load(&self.spec_draft_tokens),
            );
            r.counter(
                "vllm:spec_decode_num_accepted_tokens",
                "Number of accepted tokens.",
                load(&self.spec_accepted),
            );
        }
        r.gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            f64::from(e.running),
        );
        r.gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            f64::from(e.waiting),
        );
        r.gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            e.kv_usage(),
        );
        r.counter(
            "vllm:prompt_tokens",
            "Number of prefill tokens processed.",
            load(&self.prompt_tokens),
        );
        r.counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            load(&self.generation_tokens),
        );
        self.render_success(&mut r);
        r.histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            &self.ttft,
        );
        r.histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            &self.itl,
        );
        r.histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            &self.e2e,
        );
        r.counter(
            "sim_oom",
            "Requests failed with a simulated CUDA out-of-memory error.",
            load(&self.oom),
        );
        self.render_cache_info(&mut r);
    }

    fn render_v0(&self, mut r: Renderer<'_>, e: &EngineSnapshot) {
        r.gauge(
            "vllm:num_requests_running",
            "Number of requests currently running on GPU.",
            f64::from(e.running),
        );
        r.gauge(
            "vllm:num_requests_swapped",
            "Number of requests swapped to CPU.",
            0.0,
        );
        r.gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            f64::from(e.waiting),
        );
        r.gauge(
            "vllm:gpu_cache_usage_perc",
            "GPU KV-cache usage. 1 means 100 percent usage.",
            e.kv_usage(),
        );
        r.gauge(
            "vllm:cpu_cache_usage_perc",
            "CPU KV-cache usage. 1 means 100 percent usage.",
            0.0,
        );
        let draft = load(&self.spec_draft_tokens);
        let accepted = load(&self.spec_accepted);
        if let Some(spec) = &self.spec {
            let rate = if draft > 0.0 { accepted / draft } else { 0.0 };
            r.gauge(
                "vllm:spec_decode_draft_acceptance_rate",
                "Speulative token acceptance rate.",
                rate,
            );
            let k = f64::from(spec.num_speculative_tokens.max(1));
            let drafts = load(&self.spec_drafts);
            let emitted = accepted + drafts;
            let eff = if drafts > 0.0 {
                emitted / (drafts * (k + 1.0))
            } else {
                0.0
            };
            r.gauge(
                "vllm:spec_decode_efficiency",
                "Speculative decoding system efficiency.",
                eff,
            );
        }
        r.counter(
            "vllm:prompt_tokens",
            "Number of prefill tokens processed.",
            load(&self.prompt_tokens),
        );
        r.counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            load(&self.generation_tokens),
        );
        if self.spec.is_some() {
            r.counter(
                "vllm:spec_decode_num_accepted_tokens",
                "Number of accepted tokens.",
                accepted,
            );
            r.counter(
                "vllm:spec_decode_num_draft_tokens",
                "Number of draft tokens.",
                draft,
            );
            r.counter(
                "vllm:spec_decode_num_emitted_tokens",
                "Number of emitted tokens.",
                accepted + load(&self.spec_drafts),
            );
        }
        self.render_success(&mut r);
        r.histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            &self.ttft,
        );
        r.histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds.",
            &self.itl,
        );
        r.histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of end to end request latency in seconds.",
            &self.e2e,
        );
        r.counter(
            "sim_oom",
            "Requests failed with a simulated CUDA out-of-memory error.",
            load(&self.oom),
        );
        self.render_cache_info(&mut r);
    }

    fn render_success(&self, r: &mut Renderer<'_>) {
        let name = "vllm:request_success";
        let help = "Count of successfully processed requests.";
        r.header(&format!("{name}_total"), help, "counter");
        let reasons = ["stop", "length", "abort"];
        for (reason, c) in reasons.iter().zip(&self.success) {
            let labels = r.labels(&[("finished_reason", reason)]);
            r.sample(&format!("{name}_total"), &labels, load(c));
        }
        if r.v1 {
            r.header(&format!("{name}_created"), help, "gauge");
            for reason in reasons {
                let labels = r.labels(&[("finished_reason", reason)]);
                r.sample(&format!("{name}_created"), &labels, r.created);
            }
        }
    }

    fn render_cache_info(&self, r: &mut Renderer<'_>) {
        let bs = self.block_size.to_string();
        let nb = self.num_gpu_blocks.to_string();
        if r.v1 {
            r.header(
                "vllm:cache_config_info",
                "Information of the LLMEngine CacheConfig",
                "gauge",
            );
            let _ = writeln!(
                r.out,
                "vllm:cache_config_info{{block_size=\"{bs}\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",engine=\"0\",gpu_memory_utilization=\"0.9\",num_cpu_blocks=\"None\",num_gpu_blocks=\"{nb}\",swap_space=\"4.0\"}} 1.0"
            );
        } else {
            r.header(
                "vllm:cache_config_info",
                "information of cache_config",
                "gauge",
            );
            let _ = writeln!(
                r.out,
                "vllm:cache_config_info{{block_size=\"{bs}\",cache_dtype=\"auto\",enable_prefix_caching=\"False\",gpu_memory_utilization=\"0.9\",num_cpu_blocks=\"2048\",num_gpu_blocks=\"{nb}\",swap_space=\"4\"}} 1.0"
            );
        }
    }
}

fn load(a: &AtomicU64) -> f64 {
    a.load(Ordering::Relaxed) as f64
}

struct Renderer<'a> {
    out: &'a mut String,
    v1: bool,
    model: String,
    created: f64,
}

impl Renderer<'_> {
    fn header(&mut self, name: &str, help: &str, kind: &str) {
        let _ = writeln!(self.out, "# HELP {name} {help}");
        let _ = writeln!(self.out, "# TYPE {name} {kind}");
    }

    /// The instance labels plus `extra`, sorted by name like the fixtures.
    fn labels(&self, extra: &[(&str, &str)]) -> String {
        let mut all: Vec<(&str, &str)> = vec![("model_name", self.model.as_str())];
        if self.v1 {
            all.push(("engine", "0"));
        }
        all.extend_from_slice(extra);
        all.sort_by(|a, b| a.0.cmp(b.0));
        let parts: Vec<String> = all.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
        parts.join(",")
    }

    fn sample(&mut self, name: &str, labels: &str, v: f64) {
        let _ = writeln!(self.out, "{name}{{{labels}}} {}", go_float(v));
    }

    fn gauge(&mut self, name: &str, help: &str, v: f64) {
        self.header(name, help, "gauge");
        let labels = self.labels(&[]);
        self.sample(name, &labels, v);
    }

    fn counter(&mut self, base: &str, help: &str, v: f64) {
        let total = format!("{base}_total");
        self.header(&total, help, "counter");
        let labels = self.labels(&[]);
        self.sample(&total, &labels, v);
        self.created_family(base, help);
    }

    fn created_family(&mut self, base: &str, help: &str) {
        if self.v1 {
            let created = format!("{base}_created");
            self.header(&created, help, "gauge");
            let labels = self.labels(&[]);
            let c = self.created;
            self.sample(&created, &labels, c);
        }
    }

    fn histogram(&mut self, name: &str, help: &str, h: &Histogram) {
        self.header(name, help, "histogram");
        let mut cum = 0u64;
        for (b, c) in h.bounds.iter().zip(&h.counts) {
            cum += c.load(Ordering::Relaxed);
            let le = go_float(*b);
            let labels = self.labels(&[("le", &le)]);
            self.sample(&format!("{name}_bucket"), &labels, cum as f64);
        }
        let count = h.count.load(Ordering::Relaxed);
        let labels = self.labels(&[("le", "+Inf")]);
        self.sample(&format!("{name}_bucket"), &labels, count as f64);
        let labels = self.labels(&[]);
        self.sample(&format!("{name}_count"), &labels, count as f64);
        let sum = f64::from_bits(h.sum_bits.load(Ordering::Relaxed));
        self.sample(&format!("{name}_sum"), &labels, sum);
        self.created_family(name, help);
    }
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// prometheus_client's floatToGoString: Python repr, with an exponent once there are more
/// than 6 digits before the point (2412903.0 -> 2.412903e+06).
pub fn go_float(d: f64) -> String {
    if d.is_nan() {
        return "NaN".into();
    }
    if d == f64::INFINITY {
        return "+Inf".into();
    }
    if d == f64::NEG_INFINITY {
        return "-Inf".into();
    }
    let s = if d.fract() == 0.0 && d.abs() < 1e16 {
        format!("{d:.1}")
    } else {
        format!("{d:?}")
    };
    if d > 0.0 {
        if let Some(dot) = s.find('.') {
            if dot > 6 && !s.contains('e') {
                let digits = format!("{}{}", &s[1..dot], &s[dot + 1..]);
                let mantissa = format!("{}.{}", &s[..1], digits);
                let mantissa = mantissa.trim_end_matches('0').trim_end_matches('.');
                return format!("{mantissa}e+0{}", dot - 1);
            }
        }
    }
    s
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
