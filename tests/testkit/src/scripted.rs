//! A raw HTTP/1.1 upstream that answers every request with exact bytes, at chosen moments, and
//! records what it received.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// What a [`Scripted`] upstream received.
#[derive(Debug, Clone)]
pub struct Received {
    pub head: String,
    pub body: Vec<u8>,
}

/// How a [`Scripted`] upstream answers: a head, then body chunks, each after a pause.
#[derive(Clone)]
pub struct Script {
    pub head: Vec<u8>,
    pub chunks: Vec<(Duration, Vec<u8>)>,
}

impl Script {
    /// A complete response with `content-length`.
    pub fn fixed(content_type: &str, body: Vec<u8>) -> Self {
        let head = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\n\r\n",
            body.len()
        );
        Self {
            head: head.into_bytes(),
            chunks: vec![(Duration::ZERO, body)],
        }
    }

    /// A chunked event stream: each event sent as one HTTP chunk after `pause`.
    pub fn event_stream(events: Vec<Vec<u8>>, pause: Duration) -> Self {
        let head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n".to_vec();
        let mut chunks: Vec<(Duration, Vec<u8>)> = events
            .into_iter()
            .map(|e| {
                let mut c = format!("{:x}\r\n", e.len()).into_bytes();
                c.extend_from_slice(&e);
                c.extend_from_slice(b"\r\n");
                (pause, c)
            })
            .collect();
        chunks.push((Duration::ZERO, b"0\r\n\r\n".to_vec()));
        Self { head, chunks }
    }
}

/// A raw HTTP/1.1 upstream that answers every request with its [`Script`].
pub struct Scripted {
    pub addr: SocketAddr,
    pub received: Arc<Mutex<Vec<Received>>>,
    /// When the last chunk of the latest response was written.
    pub last_write: Arc<Mutex<Option<Instant>>>,
}

impl Scripted {
    pub async fn start(script: Script) -> Scripted {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let received = Arc::new(Mutex::new(Vec::new()));
        let last_write = Arc::new(Mutex::new(None));
        let (rec, last) = (received.clone(), last_write.clone());
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let (script, rec, last) = (script.clone(), rec.clone(), last.clone());
                tokio::spawn(async move {
                    while let Some(req) = read_request(&mut stream).await {
                        rec.lock().unwrap().push(req);
                        if stream.write_all(&script.head).await.is_err() {
                            return;
                        }
                        for (pause, chunk) in &script.chunks {
                            tokio::time::sleep(*pause).await;
                            if stream.write_all(chunk).await.is_err() {
                                return;
                            }
                            let _ = stream.flush().await;
                        }
                        *last.lock().unwrap() = Some(Instant::now());
                    }
                });
            }
        });
        Scripted {
            addr,
            received,
            last_write,
        }
    }
}

async fn read_request(stream: &mut tokio::net::TcpStream) -> Option<Received> {
    let mut buf = Vec::new();
    let mut byte = [0u8; 4096];
    let head_end = loop {
        if let Some(pos) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break pos + 4;
        }
        let n = stream.read(&mut byte).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&byte[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let len = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse::<usize>().ok())
                .flatten()
        })
        .unwrap_or(0);
    let mut body = buf[head_end..].to_vec();
    while body.len() < len {
        let n = stream.read(&mut byte).await.ok()?;
        if n == 0 {
            return None;
        }
        body.extend_from_slice(&byte[..n]);
    }
    Some(Received { head, body })
}
