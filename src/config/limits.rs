//! `limits` and `trusted_proxies`: what one client may cost, and all clients together.

use super::file::{FileConfig, LimitsFile};
use super::{Limits, MAX_TIMEOUT};
use crate::edge::ConnectionLimits;
use ipnet::IpNet;
use sluice_sdk::ConfigError as Invalid;

/// The largest request body limit accepted: bodies are held in memory whole.
const MAX_BODY_LIMIT: usize = 1 << 30;
/// Beyond this many streams per connection, one client holds a thousand requests' worth of
/// buffers on one socket; nginx allows 128, Envoy 100.
const MAX_H2_STREAMS: u32 = 1000;

pub(super) fn limits(raw: &FileConfig) -> Result<Limits, Invalid> {
    let limits = &raw.limits;
    check_body_limit(limits)?;
    check_timeouts(limits)?;
    check_caps(limits)?;
    check_memory_budget(limits)?;
    let trusted_proxies = trusted_proxies(&raw.trusted_proxies)?;
    Ok(Limits {
        max_request_body_bytes: limits.max_request_body_bytes,
        client_body_timeout: limits.client_body_timeout,
        client_body_deadline: limits.client_body_deadline,
        send_timeout: limits.send_timeout,
        max_requests_in_flight: limits.max_requests_in_flight,
        max_requests_in_flight_per_client: limits.max_requests_in_flight_per_client,
        max_buffered_bytes: limits.max_buffered_bytes,
        h2_max_concurrent_streams: limits.h2_max_concurrent_streams,
        connections: ConnectionLimits {
            max_connections: limits.max_connections,
            max_connections_per_client: limits.max_connections_per_client,
            header_timeout: limits.client_header_timeout,
        },
        trusted_proxies,
    })
}

fn check_body_limit(limits: &LimitsFile) -> Result<(), Invalid> {
    if limits.max_request_body_bytes == 0 || limits.max_request_body_bytes > MAX_BODY_LIMIT {
        return Err(Invalid::new(
            "limits.max_request_body_bytes",
            format!("must be between 1 and {MAX_BODY_LIMIT}"),
        ));
    }
    Ok(())
}

/// The client's timeouts: above 0, at most a day.
fn check_timeouts(limits: &LimitsFile) -> Result<(), Invalid> {
    for (key, value) in [
        ("client_header_timeout", limits.client_header_timeout),
        ("client_body_timeout", limits.client_body_timeout),
        ("client_body_deadline", limits.client_body_deadline),
        ("send_timeout", limits.send_timeout),
    ] {
        if value.is_zero() || value > MAX_TIMEOUT {
            return Err(Invalid::new(
                format!("limits.{key}"),
                format!(
                    "must be longer than 0 and at most {}",
                    humantime::format_duration(MAX_TIMEOUT)
                ),
            ));
        }
    }
    Ok(())
}

/// The caps on connections, requests in flight and streams per connection.
fn check_caps(limits: &LimitsFile) -> Result<(), Invalid> {
    for (key, value) in [
        ("max_connections", limits.max_connections),
        (
            "max_connections_per_client",
            limits.max_connections_per_client,
        ),
        ("max_requests_in_flight", limits.max_requests_in_flight),
        (
            "max_requests_in_flight_per_client",
            limits.max_requests_in_flight_per_client,
        ),
    ] {
        if value == 0 {
            return Err(Invalid::new(format!("limits.{key}"), "must be at least 1"));
        }
    }
    if !(1..=MAX_H2_STREAMS).contains(&limits.h2_max_concurrent_streams) {
        return Err(Invalid::new(
            "limits.h2_max_concurrent_streams",
            format!("must be between 1 and {MAX_H2_STREAMS}"),
        ));
    }
    Ok(())
}

/// The memory budget holds at least one whole request body.
fn check_memory_budget(limits: &LimitsFile) -> Result<(), Invalid> {
    if limits.max_buffered_bytes < limits.max_request_body_bytes {
        return Err(Invalid::new(
            "limits.max_buffered_bytes",
            format!(
                "must be at least limits.max_request_body_bytes ({} < {})",
                limits.max_buffered_bytes, limits.max_request_body_bytes
            ),
        ));
    }
    Ok(())
}

fn trusted_proxies(raw: &[String]) -> Result<Vec<IpNet>, Invalid> {
    raw.iter()
        .enumerate()
        .map(|(i, text)| {
            address_or_network(text).map_err(|m| Invalid::new(format!("trusted_proxies[{i}]"), m))
        })
        .collect()
}

/// An address (`10.0.0.1`) or a network (`10.0.0.0/8`).
fn address_or_network(text: &str) -> Result<IpNet, String> {
    text.parse::<IpNet>()
        .or_else(|_| text.parse::<std::net::IpAddr>().map(IpNet::from))
        .map_err(|_| format!("`{text}` is not an IP address or a network (10.0.0.0/8)"))
}
