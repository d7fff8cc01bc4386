//! The one way to declare and update a Prometheus series, in the core and in every plugin.
//!
//! ```ignore
//! sluice_sdk::metric!(REROUTED: IntCounterVec = register_int_counter_vec!(
//!     "sluice_breaker_rerouted_total", "Requests sent to another pool.", &["from", "to"]));
//! sluice_sdk::metrics::inc(&REROUTED, &["draft", "target"]);
//! ```
//!
//! Series live in `prometheus`' default registry, which the admin listener's `/metrics`
//! serves; [`prometheus`] is re-exported so that no crate can pull in a second version (whose
//! registry `/metrics` would never read). Registering or labelling never fails a request: a
//! series that cannot be made is logged once and then skipped.

use prometheus::core::{
    Atomic, GenericCounterVec, GenericGauge, GenericGaugeVec, MetricVec, MetricVecBuilder,
};
use prometheus::HistogramVec;
use std::sync::LazyLock;

pub use prometheus;

/// A lazily registered series: `None` when registration failed (only a duplicate name can).
pub type Lazy<T> = LazyLock<Option<T>>;

/// Declares a lazily registered series in the default registry:
/// `metric!(NAME: Type = register_xxx!(...));` with any `prometheus` registration macro.
#[macro_export]
macro_rules! metric {
    ($(#[$doc:meta])* $name:ident: $ty:ident = $register:ident!($($args:tt)*)) => {
        $(#[$doc])*
        pub static $name: $crate::metrics::Lazy<$crate::metrics::prometheus::$ty> =
            ::std::sync::LazyLock::new(|| {
                $crate::metrics::registered(
                    stringify!($name),
                    $crate::metrics::prometheus::$register!($($args)*),
                )
            });
    };
}

/// The registered series, or `None` after logging why not.
pub fn registered<T>(name: &str, result: prometheus::Result<T>) -> Option<T> {
    result
        .map_err(|e| tracing::error!(metric = name, "cannot register a metric: {e}"))
        .ok()
}

/// The series of `vec` with `labels`, if the vector registered.
pub fn series<P: MetricVecBuilder>(vec: &Lazy<MetricVec<P>>, labels: &[&str]) -> Option<P::M> {
    vec.as_ref()?.get_metric_with_label_values(labels).ok()
}

/// Creates the series at its zero value, so dashboards and alerts find it from start-up.
pub fn touch<P: MetricVecBuilder>(vec: &Lazy<MetricVec<P>>, labels: &[&str]) {
    let _ = series(vec, labels);
}

/// Removes the series of `vec` with `labels`: what a backend that left the pool reported
/// must not stay on the page (nor in memory) for ever.
pub fn forget<P: MetricVecBuilder>(vec: &Lazy<MetricVec<P>>, labels: &[&str]) {
    if let Some(vec) = vec.as_ref() {
        let _ = vec.remove_label_values(labels);
    }
}

/// Adds 1 to the series of `counter` with `labels`; nothing if the vector did not register or
/// the labels do not fit it.
pub fn inc<P: Atomic>(counter: &Lazy<GenericCounterVec<P>>, labels: &[&str]) {
    if let Some(c) = series(counter, labels) {
        c.inc();
    }
}

/// Adds `by` to the series of `counter` with `labels`; nothing if the vector did not register
/// or the labels do not fit it.
pub fn inc_by<P: Atomic>(counter: &Lazy<GenericCounterVec<P>>, labels: &[&str], by: P::T) {
    if let Some(c) = series(counter, labels) {
        c.inc_by(by);
    }
}

/// Sets the series of `gauge` with `labels` to `value`; nothing if the vector did not register
/// or the labels do not fit it.
pub fn set<P: Atomic>(gauge: &Lazy<GenericGaugeVec<P>>, labels: &[&str], value: P::T) {
    if let Some(g) = series(gauge, labels) {
        g.set(value);
    }
}

/// Records `value` in the series of `histogram` with `labels`; nothing if the vector did not
/// register or the labels do not fit it.
pub fn observe(histogram: &Lazy<HistogramVec>, labels: &[&str], value: f64) {
    if let Some(h) = series(histogram, labels) {
        h.observe(value);
    }
}

/// Sets an unlabelled gauge.
pub fn set_gauge<P: Atomic>(gauge: &Lazy<GenericGauge<P>>, value: P::T) {
    if let Some(g) = gauge.as_ref() {
        g.set(value);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    crate::metric!(
        /// A test series.
        TEST_COUNTER: IntCounterVec = register_int_counter_vec!(
            "sluice_sdk_test_total", "For the test.", &["kind"]));

    #[test]
    fn a_declared_series_counts_and_a_bad_label_set_is_skipped() {
        inc(&TEST_COUNTER, &["a"]);
        inc_by(&TEST_COUNTER, &["a"], 2);
        inc(&TEST_COUNTER, &["a", "extra"]); // wrong arity: skipped, no panic
        assert_eq!(series(&TEST_COUNTER, &["a"]).unwrap().get(), 3);
        // A second registration of the same name fails softly.
        let again = registered(
            "again",
            prometheus::register_int_counter_vec!("sluice_sdk_test_total", "x", &["kind"]),
        );
        assert!(again.is_none());
    }
}
