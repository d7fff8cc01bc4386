//! Ports for what a test starts, handed out so that parallel tests do not collide.
//!
//! A port found free by binding port 0 and closing the socket is only free until someone else
//! binds it; the process the test then starts on it can lose that race. Three rules close it:
//!
//! - Within one test binary, no port is handed out twice: the OS may offer a released port
//!   again at once, and two tests of the binary, running in parallel, would then share it.
//! - A port that must stay unused for a while (a dead backend, a Redis started later in the
//!   test) is held by a bound socket that never listens ([`ReservedPort`]): connecting to it
//!   is refused, as to a closed port, and nothing else can bind it (the socket does not set
//!   `SO_REUSEADDR`, so even processes that do are refused) until the test releases it.
//! - What binds a port it was handed (the proxy, `redis-server`) counts as started only once
//!   its own process listens there, read from `/proc` (not "the port accepts": a stranger
//!   that took the port accepts too), and is started again on fresh ports when the port was
//!   taken in between. See [`crate::Proxy::start`] and [`crate::RedisServer::start`].

use std::collections::HashSet;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{LazyLock, Mutex};
use tokio::net::TcpSocket;

/// Every port this test binary has handed out.
static HANDED_OUT: LazyLock<Mutex<HashSet<u16>>> = LazyLock::new(Mutex::default);

/// A local port held by a bound socket that does not listen: connections to it are refused
/// and nobody else can bind it, until [`ReservedPort::release`] or drop.
pub struct ReservedPort {
    socket: TcpSocket,
    port: u16,
}

impl ReservedPort {
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `127.0.0.1:port`.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from((Ipv4Addr::LOCALHOST, self.port))
    }

    /// Closes the holding socket and returns the port, for a process about to bind it.
    pub fn release(self) -> u16 {
        drop(self.socket);
        self.port
    }
}

/// A port of 127.0.0.1 picked by the OS, never handed out before by this test binary, held
/// until released.
pub fn reserve_port() -> ReservedPort {
    for _ in 0..1000 {
        let socket = bound(0).expect("binding 127.0.0.1:0");
        let port = socket
            .local_addr()
            .expect("a bound socket's address")
            .port();
        if HANDED_OUT.lock().unwrap().insert(port) {
            return ReservedPort { socket, port };
        }
    }
    panic!("the OS offered no port this test binary had not handed out already");
}

/// `port` itself, reserved, when nobody holds it and it was not handed out before.
pub(crate) fn reserve_this_port(port: u16) -> Option<ReservedPort> {
    let socket = bound(port).ok()?;
    HANDED_OUT
        .lock()
        .unwrap()
        .insert(port)
        .then_some(ReservedPort { socket, port })
}

/// A port for a process the test starts at once: [`reserve_port`], released.
pub fn free_port() -> u16 {
    reserve_port().release()
}

/// A socket bound to 127.0.0.1:`port`, not listening. New sockets do not set `SO_REUSEADDR`,
/// which is what keeps others off the port.
fn bound(port: u16) -> std::io::Result<TcpSocket> {
    let socket = TcpSocket::new_v4()?;
    socket.bind(SocketAddr::from((Ipv4Addr::LOCALHOST, port)))?;
    Ok(socket)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reserved_port_refuses_connections_and_binds() {
        let reserved = reserve_port();
        let refused = std::net::TcpStream::connect(reserved.addr());
        assert_eq!(
            refused.map_err(|e| e.kind()).err(),
            Some(std::io::ErrorKind::ConnectionRefused)
        );
        // std's listener sets SO_REUSEADDR, as servers do: still refused.
        assert!(std::net::TcpListener::bind(reserved.addr()).is_err());
        let port = reserved.release();
        assert!(std::net::TcpListener::bind(("127.0.0.1", port)).is_ok());
    }

    #[test]
    fn no_port_is_handed_out_twice() {
        let ports: Vec<u16> = (0..200).map(|_| free_port()).collect();
        let distinct: HashSet<&u16> = ports.iter().collect();
        assert_eq!(distinct.len(), ports.len());
    }
}
