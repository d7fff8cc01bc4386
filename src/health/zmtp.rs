//! The two ZMQ sockets a KV-event subscriber opens, SUB to a publisher and DEALER to its replay
//! (ROUTER) socket, spoken over ZMTP 3.0 (RFC 23, NULL mechanism, TCP) with every size bounded.
//!
//! Written here, not taken from a crate, because a publisher is a peer Sluice must survive:
//! zeromq 0.7 (pure Rust) reserves a frame's declared length before a byte of it arrives, so one
//! 9-byte frame header declaring 2^40 bytes aborts the process, and it has no limit on a frame,
//! a message or its frame count; the libzmq bindings (`zmq`) have `ZMQ_MAXMSGSIZE` but mean a C
//! build and a blocking thread per socket. What Sluice needs is small: a greeting, a READY
//! command each way, a subscription, and reading frames, here read as they arrive (the buffer
//! grows with the bytes received, never with the length declared) and refused past
//! [`Limits`]. libzmq (vLLM's pyzmq) and zeromq 0.7 both accept a 3.0 peer.
//!
//! One connection per socket, no reconnection of its own: the subscriber connects again.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// What one peer may send.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// The largest message, all its frames together, in bytes.
    pub message_bytes: usize,
    /// The most frames in one message.
    pub frames: usize,
}

/// The largest command (READY with its metadata) a peer may send.
const MAX_COMMAND: usize = 64 * 1024;

/// Why a connection ended.
#[derive(Debug)]
pub enum Error {
    Endpoint(String),
    Io(std::io::Error),
    Protocol(&'static str),
    TooLarge(&'static str),
    Timeout(Duration),
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::Endpoint(e) => write!(f, "not a tcp://IP:PORT endpoint: {e}"),
            Error::Io(e) => write!(f, "{e}"),
            Error::Protocol(what) => write!(f, "the peer broke ZMTP: {what}"),
            Error::TooLarge(what) => write!(f, "the peer went over the bound: {what}"),
            Error::Timeout(t) => write!(f, "no ZMTP handshake within {t:?}"),
        }
    }
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        Error::Io(e)
    }
}

/// The socket type this side announces.
#[derive(Debug, Clone, Copy)]
pub enum SocketType {
    Sub,
    Dealer,
}

impl SocketType {
    fn name(self) -> &'static [u8] {
        match self {
            SocketType::Sub => b"SUB",
            SocketType::Dealer => b"DEALER",
        }
    }
}

/// One ZMTP connection, after its handshake.
pub struct Connection {
    stream: BufReader<TcpStream>,
    limits: Limits,
}

const MORE: u8 = 0b001;
const LONG: u8 = 0b010;
const COMMAND: u8 = 0b100;

impl Connection {
    /// Connects to `tcp://IP:PORT` (an IP literal: a publisher's name is never resolved) and
    /// greets, all within `timeout`.
    pub async fn connect(
        endpoint: &str,
        socket: SocketType,
        limits: Limits,
        timeout: Duration,
    ) -> Result<Connection, Error> {
        let addr = endpoint
            .strip_prefix("tcp://")
            .and_then(|a| a.parse::<std::net::SocketAddr>().ok())
            .ok_or_else(|| Error::Endpoint(endpoint.to_string()))?;
        let work = async {
            let stream = TcpStream::connect(addr).await?;
            stream.set_nodelay(true)?;
            let mut connection = Connection {
                stream: BufReader::with_capacity(64 * 1024, stream),
                limits,
            };
            connection.handshake(socket).await?;
            Ok(connection)
        };
        tokio::time::timeout(timeout, work)
            .await
            .map_err(|_| Error::Timeout(timeout))?
    }

    async fn handshake(&mut self, socket: SocketType) -> Result<(), Error> {
        let mut greeting = [0u8; 64];
        greeting[0] = 0xff;
        greeting[9] = 0x7f;
        greeting[10] = 3; // version 3.0
        greeting[12..16].copy_from_slice(b"NULL");
        self.stream.get_mut().write_all(&greeting).await?;
        let mut theirs = [0u8; 64];
        self.stream.read_exact(&mut theirs).await?;
        if theirs[0] != 0xff || theirs[9] != 0x7f {
            return Err(Error::Protocol("not a ZMTP greeting"));
        }
        if theirs[10] < 3 {
            return Err(Error::Protocol("a ZMTP version before 3.0"));
        }
        if &theirs[12..32] != b"NULL\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0" {
            return Err(Error::Protocol("a security mechanism other than NULL"));
        }
        // READY: the command's name, then its properties (name, 4-byte length, value).
        let mut ready = Vec::with_capacity(32);
        ready.push(5);
        ready.extend_from_slice(b"READY");
        ready.push(11);
        ready.extend_from_slice(b"Socket-Type");
        let kind = socket.name();
        ready.extend_from_slice(&(kind.len() as u32).to_be_bytes());
        ready.extend_from_slice(kind);
        self.write_frame(COMMAND, &ready).await?;
        self.stream.get_mut().flush().await?;
        match self.read_frame(MAX_COMMAND).await? {
            (flags, body) if flags & COMMAND != 0 && body.starts_with(b"\x05READY") => Ok(()),
            (flags, _) if flags & COMMAND != 0 => Err(Error::Protocol("expected READY")),
            _ => Err(Error::Protocol("a message before the handshake ended")),
        }
    }

    /// Subscribes to messages whose first frame starts with `topic` (ZMTP 3.0's form: a
    /// message of `0x01` and the topic).
    pub async fn subscribe(&mut self, topic: &[u8]) -> Result<(), Error> {
        let mut body = Vec::with_capacity(1 + topic.len());
        body.push(1);
        body.extend_from_slice(topic);
        self.send(&[&body]).await
    }

    /// Sends one message.
    pub async fn send(&mut self, frames: &[&[u8]]) -> Result<(), Error> {
        for (i, frame) in frames.iter().enumerate() {
            let more = if i + 1 < frames.len() { MORE } else { 0 };
            self.write_frame(more, frame).await?;
        }
        self.stream.get_mut().flush().await?;
        Ok(())
    }

    async fn write_frame(&mut self, flags: u8, body: &[u8]) -> Result<(), Error> {
        let out = self.stream.get_mut();
        match u8::try_from(body.len()) {
            Ok(short) => out.write_all(&[flags, short]).await?,
            Err(_) => {
                out.write_all(&[flags | LONG]).await?;
                out.write_all(&(body.len() as u64).to_be_bytes()).await?;
            }
        }
        out.write_all(body).await?;
        Ok(())
    }

    /// The next message; commands (a peer's PING or metadata) are skipped. An error ends
    /// the connection: what was read of a message over the bound is never kept.
    pub async fn recv(&mut self) -> Result<Vec<Bytes>, Error> {
        let mut frames = Vec::new();
        let mut total = 0usize;
        loop {
            let room = self.limits.message_bytes.saturating_sub(total);
            let (flags, body) = self.read_frame(room.max(MAX_COMMAND)).await?;
            if flags & COMMAND != 0 {
                if body.len() > MAX_COMMAND {
                    return Err(Error::TooLarge("a command"));
                }
                if !frames.is_empty() {
                    return Err(Error::Protocol("a command inside a message"));
                }
                continue;
            }
            total += body.len();
            if total > self.limits.message_bytes {
                return Err(Error::TooLarge("message bytes"));
            }
            frames.push(body);
            if frames.len() > self.limits.frames {
                return Err(Error::TooLarge("frames in a message"));
            }
            if flags & MORE == 0 {
                return Ok(frames);
            }
        }
    }

    /// One frame, refused if it declares more than `bound` bytes. Its body is read as it
    /// arrives, so what is held is what the peer really sent.
    async fn read_frame(&mut self, bound: usize) -> Result<(u8, Bytes), Error> {
        let flags = self.stream.read_u8().await?;
        if flags & !(MORE | LONG | COMMAND) != 0 {
            return Err(Error::Protocol("reserved frame flags set"));
        }
        let len = if flags & LONG != 0 {
            self.stream.read_u64().await?
        } else {
            u64::from(self.stream.read_u8().await?)
        };
        let len = usize::try_from(len)
            .ok()
            .filter(|&len| len <= bound)
            .ok_or(Error::TooLarge("a frame's declared length"))?;
        let mut body = BytesMut::with_capacity(len.min(64 * 1024));
        while body.len() < len {
            body.reserve((len - body.len()).min(64 * 1024));
            let want = (len - body.len()).min(body.capacity() - body.len());
            let read = (&mut self.stream)
                .take(want as u64)
                .read_buf(&mut body)
                .await?;
            if read == 0 {
                return Err(Error::Io(std::io::ErrorKind::UnexpectedEof.into()));
            }
        }
        Ok((flags, body.freeze()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;
    use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

    const LIMITS: Limits = Limits {
        message_bytes: 1024 * 1024,
        frames: 4,
    };
    const WITHIN: Duration = Duration::from_secs(5);

    /// A peer that greets and says READY as a publisher does, then sends `then`.
    async fn lying_peer(then: Vec<u8>) -> u16 {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut greeting = [0u8; 64];
            greeting[0] = 0xff;
            greeting[9] = 0x7f;
            greeting[10] = 3;
            greeting[12..16].copy_from_slice(b"NULL");
            stream.write_all(&greeting).await.unwrap();
            let mut theirs = [0u8; 64];
            stream.read_exact(&mut theirs).await.unwrap();
            let ready = b"\x05READY\x0bSocket-Type\0\0\0\x03PUB";
            stream
                .write_all(&[COMMAND, ready.len() as u8])
                .await
                .unwrap();
            stream.write_all(ready).await.unwrap();
            stream.write_all(&then).await.unwrap();
            // Holds the connection open, sending nothing more.
            let mut rest = Vec::new();
            let _ = stream.read_to_end(&mut rest).await;
        });
        port
    }

    /// What a SUB connection to the peer on `port` reads first.
    async fn first_message(port: u16) -> Result<Vec<Bytes>, Error> {
        let endpoint = format!("tcp://127.0.0.1:{port}");
        let mut sub = Connection::connect(&endpoint, SocketType::Sub, LIMITS, WITHIN)
            .await
            .unwrap();
        sub.recv().await
    }

    #[tokio::test]
    async fn a_huge_declared_frame_is_refused_before_anything_is_reserved() {
        // Flags LONG, then 2^40: the header zeromq 0.7 reserves a terabyte for.
        let mut lie = vec![LONG];
        lie.extend_from_slice(&(1u64 << 40).to_be_bytes());
        let port = lying_peer(lie).await;
        assert!(matches!(first_message(port).await, Err(Error::TooLarge(_))));
    }

    #[tokio::test]
    async fn a_message_over_the_bound_in_small_frames_is_refused() {
        // 2,000 frames of 255 bytes, each with MORE: over the frame count at the fifth.
        let mut lie = Vec::new();
        for _ in 0..2000 {
            lie.extend_from_slice(&[MORE, 255]);
            lie.extend_from_slice(&[7; 255]);
        }
        let port = lying_peer(lie).await;
        assert!(matches!(first_message(port).await, Err(Error::TooLarge(_))));
        // And by bytes, in frames each under the bound.
        let mut lie = Vec::new();
        for _ in 0..3 {
            lie.push(MORE | LONG);
            lie.extend_from_slice(&(600_000u64).to_be_bytes());
            lie.extend_from_slice(&vec![1; 600_000]);
        }
        let port = lying_peer(lie).await;
        assert!(matches!(first_message(port).await, Err(Error::TooLarge(_))));
    }

    #[tokio::test]
    async fn a_peer_that_never_greets_times_out() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let _held = tokio::spawn(async move {
            let (stream, _) = listener.accept().await.unwrap();
            tokio::time::sleep(Duration::from_secs(60)).await;
            drop(stream);
        });
        let result = Connection::connect(
            &format!("tcp://127.0.0.1:{port}"),
            SocketType::Sub,
            LIMITS,
            Duration::from_millis(200),
        )
        .await;
        assert!(matches!(result, Err(Error::Timeout(_))));
    }

    #[tokio::test]
    async fn names_are_never_resolved() {
        for endpoint in ["tcp://localhost:5557", "ipc:///tmp/kv", "tcp://10.0.0.1"] {
            let result = Connection::connect(endpoint, SocketType::Sub, LIMITS, WITHIN).await;
            assert!(matches!(result, Err(Error::Endpoint(_))), "{endpoint}");
        }
    }

    /// Against zeromq's own PUB and ROUTER (the simulator's publisher): subscribes, receives
    /// a message of three frames (one over 255 bytes: a long frame), and asks a ROUTER.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn speaks_to_real_zmq_sockets() {
        let mut publisher = zeromq::PubSocket::new();
        let zeromq::Endpoint::Tcp(_, port) = publisher.bind("tcp://127.0.0.1:0").await.unwrap()
        else {
            panic!("tcp")
        };
        let mut sub = Connection::connect(
            &format!("tcp://127.0.0.1:{port}"),
            SocketType::Sub,
            LIMITS,
            WITHIN,
        )
        .await
        .unwrap();
        sub.subscribe(b"kv").await.unwrap();
        let big = vec![9u8; 1000];
        let received = tokio::spawn(async move { sub.recv().await.unwrap() });
        // A subscription reaches the publisher after the handshake: published until heard.
        for _ in 0..400 {
            if received.is_finished() {
                break;
            }
            let message = ZmqMessage::try_from(vec![
                Bytes::from_static(b"kv"),
                Bytes::from_static(&[0, 0, 0, 0, 0, 0, 0, 7]),
                Bytes::from(big.clone()),
            ])
            .unwrap();
            publisher.send(message).await.unwrap();
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        let frames = received.await.unwrap();
        assert_eq!(frames.len(), 3);
        assert_eq!(&frames[0][..], b"kv");
        assert_eq!(frames[2].len(), 1000);

        let mut router = zeromq::RouterSocket::new();
        let zeromq::Endpoint::Tcp(_, port) = router.bind("tcp://127.0.0.1:0").await.unwrap() else {
            panic!("tcp")
        };
        let mut dealer = Connection::connect(
            &format!("tcp://127.0.0.1:{port}"),
            SocketType::Dealer,
            LIMITS,
            WITHIN,
        )
        .await
        .unwrap();
        dealer.send(&[b"", &5u64.to_be_bytes()]).await.unwrap();
        let asked = router.recv().await.unwrap().into_vec();
        assert_eq!(&asked[2][..], &5u64.to_be_bytes());
        let reply = ZmqMessage::try_from(vec![
            asked[0].clone(),
            Bytes::new(),
            Bytes::from_static(b"answer"),
        ])
        .unwrap();
        router.send(reply).await.unwrap();
        let answer = dealer.recv().await.unwrap();
        assert_eq!(&answer[1][..], b"answer");
    }
}
