//! An SSE client that timestamps every chunk of a streamed answer as it arrives: time to first
//! token (TTFT), the gaps between chunks, and how many SSE events each chunk held (more than
//! one means someone merged chunks on the way).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use hdrhistogram::Histogram;
use http_body_util::BodyExt;

use crate::loadgen::{connect, histogram, record, Target};

/// How to drive streams.
#[derive(Clone, Debug)]
pub struct SseLoad {
    /// Streams open at once (one connection each).
    pub concurrency: usize,
    /// Start new streams until this much time has passed (a running stream is finished).
    pub duration: Duration,
    /// Each worker runs exactly one stream (the open-streams scenario).
    pub once: bool,
    /// Spread the workers' first streams over this long.
    pub ramp: Duration,
}

impl SseLoad {
    /// `concurrency` streams open at a time for `duration`, each followed at once by the next
    /// on its slot, their first starts spread over one stream's length (`tokens` × `itl_ms`),
    /// as clients arrive. Started together, they would keep arriving in waves of
    /// `concurrency`, and TTFT p99 would measure the last request of a wave queued behind the
    /// others on these 2 shared cores (direct to the simulator included: 7.7 ms in one run).
    pub fn steady(concurrency: usize, duration: Duration, tokens: u32, itl_ms: f64) -> SseLoad {
        let stream_length = Duration::from_secs_f64(f64::from(tokens) * itl_ms / 1000.0);
        SseLoad {
            concurrency,
            duration,
            once: false,
            ramp: stream_length.min(duration / 2),
        }
    }
}

/// What the streams measured.
#[derive(Clone, Debug)]
pub struct SseResult {
    pub streams: u64,
    pub errors: u64,
    pub first_error: Option<String>,
    /// From sending the request to the first body chunk, ns.
    pub ttft: Histogram<u64>,
    /// Between consecutive body chunks of a stream, ns.
    pub gaps: Histogram<u64>,
    /// Body chunks (reads of the chunked body) over all streams.
    pub chunks: u64,
    /// SSE events (`data:` lines) over all streams.
    pub events: u64,
    /// Chunks that held more than one event.
    pub merged: u64,
}

impl SseResult {
    /// No streams yet: what workers start from and results are merged into.
    pub(crate) fn empty() -> Result<SseResult> {
        Ok(SseResult {
            streams: 0,
            errors: 0,
            first_error: None,
            ttft: histogram()?,
            gaps: histogram()?,
            chunks: 0,
            events: 0,
            merged: 0,
        })
    }

    /// Adds another worker's streams to these.
    pub(crate) fn merge(&mut self, o: SseResult) {
        self.streams += o.streams;
        self.errors += o.errors;
        self.chunks += o.chunks;
        self.events += o.events;
        self.merged += o.merged;
        if self.first_error.is_none() {
            self.first_error = o.first_error;
        }
        let _ = self.ttft.add(&o.ttft);
        let _ = self.gaps.add(&o.gaps);
    }

    /// Body chunks per stream.
    pub fn chunks_per_stream(&self) -> f64 {
        self.chunks as f64 / (self.streams.max(1)) as f64
    }

    /// SSE events per stream.
    pub fn events_per_stream(&self) -> f64 {
        self.events as f64 / (self.streams.max(1)) as f64
    }
}

fn ms(h: &Histogram<u64>, percentile: f64) -> f64 {
    h.value_at_percentile(percentile) as f64 / 1e6
}

impl SseResult {
    pub fn ttft_ms(&self, p: f64) -> f64 {
        ms(&self.ttft, p)
    }
    pub fn gap_ms(&self, p: f64) -> f64 {
        ms(&self.gaps, p)
    }
}

/// Counts the SSE events that start in `data`.
pub(crate) fn count_events(data: &[u8]) -> u64 {
    let mut n = 0;
    let mut at_line_start = true;
    let mut i = 0;
    while i < data.len() {
        if at_line_start && data[i..].starts_with(b"data:") {
            n += 1;
        }
        at_line_start = data[i] == b'\n';
        i += 1;
    }
    n
}

/// Runs the streams; `open` counts the streams that got their first chunk and have not ended.
pub async fn run(target: Arc<Target>, load: SseLoad, open: Arc<AtomicUsize>) -> Result<SseResult> {
    let start = Instant::now();
    let end = start + load.duration;
    let n = load.concurrency.max(1);
    let mut tasks = Vec::with_capacity(n);
    for i in 0..n {
        let (target, open, load) = (target.clone(), open.clone(), load.clone());
        let delay = load.ramp.mul_f64(i as f64 / n as f64);
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            let mut out = SseResult::empty()?;
            loop {
                if let Err(e) = one_stream(&target, &mut out, &open).await {
                    out.errors += 1;
                    if out.first_error.is_none() {
                        out.first_error = Some(format!("{e:#}"));
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                if load.once || Instant::now() >= end {
                    break;
                }
            }
            Ok::<_, anyhow::Error>(out)
        }));
    }
    let mut total = SseResult::empty()?;
    for t in tasks {
        total.merge(t.await.context("a stream task panicked")??);
    }
    Ok(total)
}

/// Decrements the open-stream count when a stream that was counted ends, however it ends.
struct OpenGuard<'a>(Option<&'a AtomicUsize>);

impl Drop for OpenGuard<'_> {
    fn drop(&mut self) {
        if let Some(c) = self.0 {
            c.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

async fn one_stream(target: &Target, out: &mut SseResult, open: &AtomicUsize) -> Result<()> {
    // A fresh connection per stream, as most SDK clients under load end up doing.
    let mut sender = connect(target.addr).await?;
    sender.ready().await.context("connection closed")?;
    let t0 = Instant::now();
    let resp = sender
        .send_request(target.request()?)
        .await
        .context("sending")?;
    let status = resp.status();
    let headers_ok = target.check_headers(resp.headers());
    let mut body = resp.into_body();
    if !status.is_success() {
        let bytes = body
            .collect()
            .await
            .map(|c| c.to_bytes())
            .unwrap_or_default();
        bail!(
            "HTTP {status}: {}",
            String::from_utf8_lossy(&bytes[..bytes.len().min(200)])
        );
    }
    headers_ok?;
    let mut guard = OpenGuard(None);
    let mut prev: Option<Instant> = None;
    let (mut chunks, mut events, mut merged) = (0u64, 0u64, 0u64);
    let mut ttft = None;
    let mut gaps = Vec::with_capacity(128);
    let mut done = false;
    while let Some(frame) = body.frame().await {
        let frame = frame.context("reading the stream")?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        if data.is_empty() {
            continue;
        }
        let now = Instant::now();
        match prev {
            None => {
                ttft = Some(now - t0);
                open.fetch_add(1, Ordering::SeqCst);
                guard = OpenGuard(Some(open));
            }
            Some(p) => gaps.push(now - p),
        }
        prev = Some(now);
        let n = count_events(&data);
        chunks += 1;
        events += n;
        if n > 1 {
            merged += 1;
        }
        // A stream broken on the way ends with an error event, then `[DONE]`: a failure.
        let error_event = b"data: {\"error\"";
        if data.windows(error_event.len()).any(|w| w == error_event) {
            bail!("the stream ended with an error event");
        }
        if data.windows(12).any(|w| w == b"data: [DONE]") {
            done = true;
        }
    }
    drop(guard);
    if !done {
        bail!("the stream ended without data: [DONE]");
    }
    out.streams += 1;
    out.chunks += chunks;
    out.events += events;
    out.merged += merged;
    if let Some(t) = ttft {
        record(&mut out.ttft, t);
    }
    for g in gaps {
        record(&mut out.gaps, g);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::count_events;

    #[test]
    fn counts_events_at_line_starts() {
        assert_eq!(count_events(b"data: {}\n\n"), 1);
        assert_eq!(count_events(b"data: {}\n\ndata: [DONE]\n\n"), 2);
        assert_eq!(count_events(b"{\"x\":\"data: no\"}\n\n"), 0);
    }
}
