//! `listeners` and `admin`: the addresses Sluice binds, and what each offers.

use super::file::{AdminFile, ListenerFile, TlsFile};
use super::{existing_file, socket_address, Listener, TlsFiles};
use sluice_sdk::ConfigError as Invalid;
use std::net::SocketAddr;
use std::path::Path;

/// The proxy's listeners, in file order; no two may bind the same port.
pub(super) fn listeners(raw: &[ListenerFile], base: &Path) -> Result<Vec<Listener>, Invalid> {
    if raw.is_empty() {
        return Err(Invalid::new("listeners", "at least one listener is needed"));
    }
    let mut addresses: Vec<SocketAddr> = Vec::new();
    let mut listeners = Vec::new();
    for (i, l) in raw.iter().enumerate() {
        let listener = listener(l, &format!("listeners[{i}]"), base, &addresses)?;
        addresses.push(listener.address);
        listeners.push(listener);
    }
    Ok(listeners)
}

/// One listener; `taken` are the addresses of the listeners before it.
fn listener(
    l: &ListenerFile,
    key: &str,
    base: &Path,
    taken: &[SocketAddr],
) -> Result<Listener, Invalid> {
    let address =
        socket_address(&l.address).map_err(|m| Invalid::new(format!("{key}.address"), m))?;
    if let Some(other) = clash(taken, address) {
        return Err(Invalid::new(
            format!("{key}.address"),
            format!("{address} clashes with {other}"),
        ));
    }
    let tls = match &l.tls {
        None => None,
        Some(t) => Some(tls_files(t, key, base)?),
    };
    if tls.is_some() && l.h2c {
        return Err(Invalid::new(
            format!("{key}.h2c"),
            "is for plain listeners; a TLS listener offers h2 by ALPN (see http2)",
        ));
    }
    if tls.is_none() && l.http2.is_some() {
        return Err(Invalid::new(
            format!("{key}.http2"),
            "is for TLS listeners (ALPN); a plain listener takes HTTP/2 with h2c: true",
        ));
    }
    Ok(Listener {
        address,
        http2: tls.is_some() && l.http2.unwrap_or(true),
        h2c: l.h2c,
        tls,
    })
}

/// `key` is the listener's; the files are found relative to the config's folder, `base`.
fn tls_files(t: &TlsFile, key: &str, base: &Path) -> Result<TlsFiles, Invalid> {
    Ok(TlsFiles {
        cert: existing_file(base, &t.cert)
            .map_err(|m| Invalid::new(format!("{key}.tls.cert"), m))?,
        key: existing_file(base, &t.key).map_err(|m| Invalid::new(format!("{key}.tls.key"), m))?,
    })
}

/// The admin's address, when it is enabled; it may not bind a proxy listener's port.
pub(super) fn admin(
    raw: &AdminFile,
    listeners: &[Listener],
) -> Result<Option<SocketAddr>, Invalid> {
    if !raw.enabled {
        return Ok(None);
    }
    let address = socket_address(&raw.address).map_err(|m| Invalid::new("admin.address", m))?;
    let taken: Vec<SocketAddr> = listeners.iter().map(|l| l.address).collect();
    if let Some(other) = clash(&taken, address) {
        return Err(Invalid::new(
            "admin.address",
            format!("{address} clashes with the proxy listener {other}"),
        ));
    }
    Ok(Some(address))
}

/// An address in `taken` that `address` cannot bind beside: the same port on the same IP,
/// or on a wildcard (0.0.0.0, ::) that covers it.
fn clash(taken: &[SocketAddr], address: SocketAddr) -> Option<SocketAddr> {
    taken.iter().copied().find(|t| {
        t.port() == address.port()
            && (t.ip() == address.ip() || t.ip().is_unspecified() || address.ip().is_unspecified())
    })
}
