//! DNS for tests of pools whose backends come from DNS names: a real DNS server whose records
//! a test sets ([`DnsServer`], Debian's `dnsmasq`), resolvers that misbehave ([`BadDns`]), and
//! simulated vLLM backends that share one port on several loopback addresses, as the
//! addresses of one name do ([`sims_on_loopbacks`]).
//!
//! [`DnsServer`] answers only from its own hosts file and forwards nothing: a name it was not
//! given, or whose records were all removed, gets NXDOMAIN; a name with only IPv4 addresses
//! gets an empty NOERROR answer (NODATA) for AAAA, and the other way round.
//!
//! The queries the testkit itself sends ([`lookup`], [`DnsServer::query`]) are built and
//! parsed by hand here, about sixty lines for an A/AAAA question and the address records of
//! its answer: the testkit only needs to see what the server answers, and a resolver crate
//! would put its own cache, retries and search rules between the test and the server.

use crate::ports::{reserve_port, ReservedPort};
use crate::proc::{kill, listens};
use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tempfile::TempDir;
use tokio::net::UdpSocket;
use tokio::task::JoinHandle;

const HOW_TO_INSTALL: &str = "dnsmasq not found: `scripts/bootstrap --test` installs it \
                              (Debian's dnsmasq-base)";

/// How long [`lookup`] waits for an answer.
const QUERY_TIMEOUT: Duration = Duration::from_secs(1);

/// How long dnsmasq may take to start answering, or to answer with new records.
const SETTLE: Duration = Duration::from_secs(10);

/// Ports to try before giving up on starting dnsmasq.
const START_ATTEMPTS: usize = 5;

/// NXDOMAIN: the name does not exist.
pub const NXDOMAIN: u8 = 3;

/// What [`lookup`] asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordType {
    A,
    Aaaa,
}

impl RecordType {
    fn code(self) -> u16 {
        match self {
            RecordType::A => 1,
            RecordType::Aaaa => 28,
        }
    }
}

/// A DNS server's answer, as far as tests look at it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answer {
    /// 0 NOERROR, 2 SERVFAIL, 3 NXDOMAIN ([`NXDOMAIN`]), 5 REFUSED.
    pub rcode: u8,
    /// The AA flag.
    pub authoritative: bool,
    /// Every A and AAAA record of the answer section, with its TTL in seconds, in the order
    /// sent.
    pub records: Vec<(IpAddr, u32)>,
}

impl Answer {
    /// The addresses of the records, sorted.
    pub fn addrs(&self) -> Vec<IpAddr> {
        let mut addrs: Vec<IpAddr> = self.records.iter().map(|(ip, _)| *ip).collect();
        addrs.sort();
        addrs
    }
}

/// Asks `server` (over UDP, once, waiting up to a second) for `name`'s records of type
/// `rtype`. `Err` describes what came instead of a DNS answer: nothing (a timeout), a refused
/// port, or bytes that do not parse; any rcode is an `Ok` answer.
pub async fn lookup(server: SocketAddr, name: &str, rtype: RecordType) -> Result<Answer, String> {
    static NEXT_ID: AtomicU16 = AtomicU16::new(0x5100);
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    let query = encode_query(id, name, rtype)?;
    let local = match server {
        SocketAddr::V4(_) => SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0)),
        SocketAddr::V6(_) => SocketAddr::from((Ipv6Addr::UNSPECIFIED, 0)),
    };
    let socket = UdpSocket::bind(local)
        .await
        .map_err(|e| format!("binding a UDP socket: {e}"))?;
    // Connected: an ICMP "port unreachable" then fails the receive at once.
    socket
        .connect(server)
        .await
        .map_err(|e| format!("connecting to {server}: {e}"))?;
    socket
        .send(&query)
        .await
        .map_err(|e| format!("sending to {server}: {e}"))?;
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(QUERY_TIMEOUT, socket.recv(&mut buf))
        .await
        .map_err(|_| format!("no answer from {server} within {QUERY_TIMEOUT:?}"))?
        .map_err(|e| format!("receiving from {server}: {e}"))?;
    parse_answer(id, &buf[..n]).map_err(|e| format!("{server} answered {n} bytes: {e}"))
}

/// A query for `name` (a trailing dot is optional), recursion desired.
fn encode_query(id: u16, name: &str, rtype: RecordType) -> Result<Vec<u8>, String> {
    let mut msg = Vec::with_capacity(18 + name.len());
    msg.extend_from_slice(&id.to_be_bytes());
    // Flags RD; one question, no other records.
    msg.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0]);
    let name = name.strip_suffix('.').unwrap_or(name);
    if name.len() > 253 {
        return Err(format!("{name:?}: longer than 253 bytes"));
    }
    for label in name.split('.').filter(|_| !name.is_empty()) {
        let len = u8::try_from(label.len())
            .ok()
            .filter(|len| (1..=63).contains(len))
            .ok_or_else(|| format!("{name:?}: a label of {} bytes", label.len()))?;
        msg.push(len);
        msg.extend_from_slice(label.as_bytes());
    }
    msg.push(0);
    msg.extend_from_slice(&rtype.code().to_be_bytes());
    msg.extend_from_slice(&1u16.to_be_bytes()); // class IN
    Ok(msg)
}

/// The rcode, AA flag and address records of the answer to query `id`.
fn parse_answer(id: u16, msg: &[u8]) -> Result<Answer, String> {
    if msg.len() < 12 {
        return Err("shorter than a DNS header".into());
    }
    let answered = be16(msg, 0)?;
    if answered != id {
        return Err(format!("the answer's id is {answered}, the query's {id}"));
    }
    let flags = be16(msg, 2)?;
    if flags & 0x8000 == 0 {
        return Err("the QR flag is not set: not an answer".into());
    }
    let (questions, answers) = (be16(msg, 4)?, be16(msg, 6)?);
    let mut at = 12;
    for _ in 0..questions {
        at = skip_name(msg, at)? + 4;
    }
    let mut records = Vec::new();
    for _ in 0..answers {
        at = skip_name(msg, at)?;
        let rtype = be16(msg, at)?;
        let ttl = u32::from(be16(msg, at + 4)?) << 16 | u32::from(be16(msg, at + 6)?);
        let len = usize::from(be16(msg, at + 8)?);
        let data = msg
            .get(at + 10..at + 10 + len)
            .ok_or("a record runs past the end")?;
        at += 10 + len;
        let ip = match (rtype, <[u8; 4]>::try_from(data), <[u8; 16]>::try_from(data)) {
            (1, Ok(v4), _) => IpAddr::from(v4),
            (28, _, Ok(v6)) => IpAddr::from(v6),
            _ => continue, // CNAME and the like: not an address
        };
        records.push((ip, ttl));
    }
    Ok(Answer {
        rcode: (flags & 0x000f) as u8,
        authoritative: flags & 0x0400 != 0,
        records,
    })
}

fn be16(msg: &[u8], at: usize) -> Result<u16, String> {
    msg.get(at..at + 2)
        .map(|b| u16::from_be_bytes([b[0], b[1]]))
        .ok_or_else(|| format!("truncated at byte {at}"))
}

/// Where the (possibly compressed) name starting at `at` ends.
fn skip_name(msg: &[u8], mut at: usize) -> Result<usize, String> {
    loop {
        let len = *msg.get(at).ok_or("a name runs past the end")?;
        match len & 0xc0 {
            0xc0 => return Ok(at + 2),
            0 if len == 0 => return Ok(at + 1),
            0 => at += 1 + usize::from(len),
            _ => return Err(format!("a bad label length {len:#x} at byte {at}")),
        }
    }
}

/// The dnsmasq binary: on `PATH`, else Debian's `/usr/sbin/dnsmasq` (not on a user's `PATH`).
fn dnsmasq() -> PathBuf {
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .chain([PathBuf::from("/usr/sbin")])
        .map(|dir| dir.join("dnsmasq"))
        .find(|path| path.is_file())
        .unwrap_or_else(|| panic!("{HOW_TO_INSTALL}"))
}

/// Whether this process runs as root (read from `/proc`: no `libc` here).
fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|status| {
        status
            .lines()
            .find_map(|line| line.strip_prefix("Uid:"))
            .and_then(|ids| ids.split_whitespace().nth(1))
            == Some("0")
    })
}

/// A port of 127.0.0.1 free for both TCP and UDP (dnsmasq binds both), handed out as
/// [`reserve_port`] does.
fn free_dns_port() -> u16 {
    for _ in 0..100 {
        let reserved = reserve_port();
        if std::net::UdpSocket::bind(reserved.addr()).is_ok() {
            return reserved.release();
        }
    }
    panic!("no port of 127.0.0.1 was free for both TCP and UDP");
}

/// A real DNS server: `dnsmasq` on 127.0.0.1, UDP and TCP, answering from a hosts file of its
/// own that [`DnsServer::set`] writes. Killed on drop.
pub struct DnsServer {
    port: u16,
    ttl: Duration,
    dir: TempDir,
    records: Mutex<BTreeMap<String, Vec<IpAddr>>>,
    child: Option<Child>,
}

impl DnsServer {
    /// dnsmasq on 127.0.0.1 on a free port, with no records yet, answering with TTL `ttl`
    /// (whole seconds: its `--local-ttl`). Returns once it answers a query.
    ///
    /// The command line (see [`DnsServer::command`]): in the foreground, configuration and
    /// `/etc/hosts` not read, no upstream servers (`--no-resolv`) and every name local
    /// (`--local=/#/`, so unknown names get NXDOMAIN rather than REFUSED), no pid file, no
    /// lease file, as the current user (`--user=root` when root: dnsmasq would otherwise drop
    /// to `nobody`, who cannot read the hosts file again on SIGHUP), its log (every query
    /// included) in a file, [`DnsServer::log`].
    pub async fn start(ttl: Duration) -> DnsServer {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("temp dir: {e}"));
        let mut server = DnsServer {
            port: 0,
            ttl,
            dir,
            records: Mutex::default(),
            child: None,
        };
        server.write_hosts(&BTreeMap::new());
        for _ in 0..START_ATTEMPTS {
            server.port = free_dns_port();
            if let Some(child) = server.spawn_and_wait().await {
                server.child = Some(child);
                return server;
            }
        }
        panic!(
            "dnsmasq would not start ({START_ATTEMPTS} ports tried); its log:\n{}",
            server.log()
        );
    }

    /// `127.0.0.1:port`: what a resolver configuration names.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from((Ipv4Addr::LOCALHOST, self.port))
    }

    /// The TTL of every answer.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Sets every A and AAAA record of `name`, replacing what it had (empty: it has none, and
    /// is then answered NXDOMAIN), and waits until dnsmasq's answers show exactly that set:
    /// rewrites the hosts file, sends dnsmasq SIGHUP (which re-reads it and empties its
    /// cache), and asks until the answers change. While stopped ([`DnsServer::stop`]) it only
    /// rewrites the file, which [`DnsServer::start_again`] serves.
    pub async fn set(&self, name: &str, ips: &[IpAddr]) {
        let name = name.strip_suffix('.').unwrap_or(name).to_ascii_lowercase();
        let mut want = ips.to_vec();
        want.sort();
        want.dedup();
        {
            let mut records = self.records.lock().unwrap();
            if want.is_empty() {
                records.remove(&name);
            } else {
                records.insert(name.clone(), want.clone());
            }
            self.write_hosts(&records);
        }
        let Some(child) = &self.child else {
            return;
        };
        crate::signal(child.id(), "HUP");
        let (want_v4, want_v6): (Vec<IpAddr>, Vec<IpAddr>) =
            want.iter().partition(|ip| ip.is_ipv4());
        let deadline = Instant::now() + SETTLE;
        loop {
            let v4 = self.addresses(&name, RecordType::A).await;
            let v6 = self.addresses(&name, RecordType::Aaaa).await;
            if v4.as_ref() == Ok(&want_v4) && v6.as_ref() == Ok(&want_v6) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "dnsmasq still answers {name} with A {v4:?} and AAAA {v6:?}, {SETTLE:?} after \
                 it was set to {want:?}; its log:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Stops answering: kills dnsmasq (SIGKILL). Queries to the port are then refused (UDP:
    /// an ICMP port unreachable; TCP: a reset) until [`DnsServer::start_again`].
    pub async fn stop(&mut self) {
        kill(&mut self.child);
    }

    /// Starts dnsmasq again on the same port with the same records (and TTL); returns once it
    /// answers. Kills it first if it runs.
    pub async fn start_again(&mut self) {
        kill(&mut self.child);
        let deadline = Instant::now() + SETTLE;
        loop {
            // Fails only when something took the port in between (a resolver's source port,
            // say): such holders tend to go away.
            if let Some(child) = self.spawn_and_wait().await {
                self.child = Some(child);
                return;
            }
            assert!(
                Instant::now() < deadline,
                "dnsmasq would not start again on port {}; its log:\n{}",
                self.port,
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Whether dnsmasq runs (between [`DnsServer::stop`] and [`DnsServer::start_again`] it
    /// does not).
    pub fn running(&self) -> bool {
        self.child.is_some()
    }

    /// Asks the server for `name`'s A records now: their addresses, sorted (none for NXDOMAIN
    /// and NODATA), or what came instead of an answer (a timeout, a refusal, another rcode).
    pub async fn query(&self, name: &str) -> Result<Vec<IpAddr>, String> {
        self.addresses(name, RecordType::A).await
    }

    /// The full answer to a query for `name`'s records of type `rtype`: rcode, AA flag, TTLs.
    pub async fn lookup(&self, name: &str, rtype: RecordType) -> Result<Answer, String> {
        lookup(self.addr(), name, rtype).await
    }

    /// dnsmasq's log so far, across restarts: startup lines, then a `query[A] NAME from
    /// 127.0.0.1` line per query and a line per reply.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// How many queries (any type) dnsmasq has received for `name` so far, counting the
    /// testkit's own ([`DnsServer::set`] asks for A and AAAA until the answer shows the new
    /// records; [`DnsServer::query`] asks once).
    pub fn queries(&self, name: &str) -> usize {
        let name = name.strip_suffix('.').unwrap_or(name);
        let needle = format!("] {name} from ");
        self.log()
            .lines()
            .filter(|line| line.contains(": query[") && line.contains(&needle))
            .count()
    }

    /// The arguments dnsmasq is started with (after the binary, `dnsmasq` on `PATH` or
    /// `/usr/sbin/dnsmasq`).
    pub fn command(&self) -> Vec<String> {
        let mut args: Vec<String> = [
            "--keep-in-foreground",
            "--conf-file=/dev/null",
            "--listen-address=127.0.0.1",
            "--bind-interfaces",
            "--no-resolv",
            "--no-hosts",
            "--local=/#/",
            "--pid-file=",
            "--leasefile-ro",
            "--log-facility=-",
            "--log-queries",
        ]
        .map(String::from)
        .into();
        args.push(format!("--port={}", self.port));
        args.push(format!("--addn-hosts={}", self.hosts_path().display()));
        args.push(format!("--local-ttl={}", self.ttl.as_secs()));
        if is_root() {
            args.push("--user=root".into());
        }
        args
    }

    async fn addresses(&self, name: &str, rtype: RecordType) -> Result<Vec<IpAddr>, String> {
        let answer = self.lookup(name, rtype).await?;
        match answer.rcode {
            0 | NXDOMAIN => Ok(answer.addrs()),
            rcode => Err(format!("rcode {rcode} for {name}")),
        }
    }

    /// Starts dnsmasq on `self.port` and waits until it listens there itself and answers;
    /// `None` when it exited first (the port was taken).
    async fn spawn_and_wait(&self) -> Option<Child> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .unwrap_or_else(|e| panic!("dnsmasq's log file: {e}"));
        let mut child = Some(
            Command::new(dnsmasq())
                .args(self.command())
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .unwrap_or_else(|e| panic!("cannot start dnsmasq: {e}; {HOW_TO_INSTALL}")),
        );
        let deadline = Instant::now() + SETTLE;
        while Instant::now() < deadline {
            let running = child.as_mut().expect("spawned");
            if let Ok(Some(_)) = running.try_wait() {
                return None;
            }
            // Its own TCP listener, so that the answer below is its own too (it binds UDP
            // before it serves, or exits).
            if listens(running.id(), self.port)
                && lookup(self.addr(), "testkit-probe.invalid", RecordType::A)
                    .await
                    .is_ok()
            {
                return child;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        kill(&mut child);
        panic!(
            "dnsmasq on port {} did not answer within {SETTLE:?}; its log:\n{}",
            self.port,
            self.log()
        );
    }

    fn hosts_path(&self) -> PathBuf {
        self.dir.path().join("hosts")
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("dnsmasq.log")
    }

    /// Replaces the hosts file at once (a rename), so dnsmasq never reads half of it.
    fn write_hosts(&self, records: &BTreeMap<String, Vec<IpAddr>>) {
        let text: String = records
            .iter()
            .flat_map(|(name, ips)| ips.iter().map(move |ip| format!("{ip} {name}\n")))
            .collect();
        let next = self.dir.path().join("hosts.next");
        write(&next, &text);
        std::fs::rename(&next, self.hosts_path())
            .unwrap_or_else(|e| panic!("replacing the hosts file: {e}"));
    }
}

fn write(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
}

impl Drop for DnsServer {
    fn drop(&mut self) {
        kill(&mut self.child);
    }
}

/// How a [`BadDns`] answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Misbehaviour {
    /// With bytes that are not a DNS message (the query's id, then junk), at once.
    Garbage,
    /// Never: queries are read and dropped.
    Silent,
    /// With SERVFAIL (rcode 2) to the question asked, at once.
    ServFail,
}

/// A UDP "resolver" on 127.0.0.1 on a free port that misbehaves as told. TCP connections to its
/// port are refused. Stops when dropped.
pub struct BadDns {
    addr: SocketAddr,
    task: JoinHandle<()>,
    _tcp: ReservedPort,
}

impl BadDns {
    pub async fn start(how: Misbehaviour) -> BadDns {
        for _ in 0..100 {
            let reserved = reserve_port();
            let Ok(socket) = UdpSocket::bind(reserved.addr()).await else {
                continue;
            };
            let task = tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                loop {
                    let Ok((n, from)) = socket.recv_from(&mut buf).await else {
                        continue;
                    };
                    let reply = match how {
                        Misbehaviour::Silent => continue,
                        Misbehaviour::Garbage => garbage(&buf[..n]),
                        Misbehaviour::ServFail => match servfail(&buf[..n]) {
                            Some(reply) => reply,
                            None => continue,
                        },
                    };
                    let _ = socket.send_to(&reply, from).await;
                }
            });
            return BadDns {
                addr: reserved.addr(),
                task,
                _tcp: reserved,
            };
        }
        panic!("no port of 127.0.0.1 was free for both TCP and UDP");
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for BadDns {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The query's id, so that a client takes it for the answer, then bytes that do not parse:
/// flags with every bit set (a response, opcode 15, rcode 15), 65535 of each section, and
/// text where the first question should be.
fn garbage(query: &[u8]) -> Vec<u8> {
    let mut reply = query.get(..2).unwrap_or(&[0, 0]).to_vec();
    reply.extend_from_slice(&[0xff; 10]);
    reply.extend_from_slice(&[0xc0; 3]);
    reply.extend_from_slice(b"sluice-testkit: garbage, not DNS");
    reply
}

/// SERVFAIL to the query's question: its header and question, flags QR, RA and rcode 2 (the
/// opcode and RD kept), no records.
fn servfail(query: &[u8]) -> Option<Vec<u8>> {
    let questions = be16(query, 4).ok()?;
    let mut end = 12;
    for _ in 0..questions {
        end = skip_name(query, end).ok()? + 4;
    }
    let mut reply = query.get(..end)?.to_vec();
    let flags = (be16(query, 2).ok()? & 0x7900) | 0x8000 | 0x0080 | 2;
    reply[2..4].copy_from_slice(&flags.to_be_bytes());
    reply[6..12].fill(0);
    Some(reply)
}

/// `count` simulated vLLM servers serving `model`, on 127.0.0.2, 127.0.0.3, ... (Linux
/// routes all of 127.0.0.0/8 to `lo`), all on the same port, which is returned: the
/// addresses of one DNS name with the one port of a pool's config. `sims[i]` is on
/// 127.0.0.(i + 2).
pub async fn sims_on_loopbacks(count: usize, model: &str) -> (u16, Vec<vllm_sim::Sim>) {
    let config = vllm_sim::SimConfig::default().with_model(model);
    sims_on_loopbacks_with(vec![config; count]).await
}

/// [`sims_on_loopbacks`] with a config per simulator (its `listen` is replaced).
pub async fn sims_on_loopbacks_with(
    configs: Vec<vllm_sim::SimConfig>,
) -> (u16, Vec<vllm_sim::Sim>) {
    assert!(configs.len() <= 253, "127.0.0.2 to 127.0.0.254 at most");
    let mut last_error = None;
    for _ in 0..20 {
        // Handed out on 127.0.0.1 too, so no other test of this binary is given it.
        let port = reserve_port().port();
        let mut sims = Vec::with_capacity(configs.len());
        for (i, config) in configs.iter().enumerate() {
            let ip = Ipv4Addr::new(127, 0, 0, (i + 2) as u8);
            let listen = SocketAddr::from((ip, port));
            match vllm_sim::start(config.clone().with_listen(listen)).await {
                Ok(sim) => sims.push(sim),
                Err(e) => {
                    last_error = Some(format!("{listen}: {e}"));
                    break;
                }
            }
        }
        if sims.len() == configs.len() {
            return (port, sims);
        }
        sims.iter().for_each(vllm_sim::Sim::shutdown);
    }
    panic!(
        "no port was free on all of 127.0.0.2..={}: last {}",
        configs.len() + 1,
        last_error.unwrap_or_default()
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    #[tokio::test]
    async fn dnsmasq_answers_what_is_set_and_sees_it_change() {
        let dns = DnsServer::start(Duration::from_secs(7)).await;
        assert_eq!(dns.query("pool.test").await, Ok(vec![]));
        let unknown = dns.lookup("pool.test", RecordType::A).await.unwrap();
        assert_eq!(unknown.rcode, NXDOMAIN);

        dns.set("pool.test", &[ip("10.1.0.2"), ip("10.1.0.1")])
            .await;
        assert_eq!(
            dns.query("pool.test").await,
            Ok(vec![ip("10.1.0.1"), ip("10.1.0.2")])
        );
        let answer = dns.lookup("pool.test", RecordType::A).await.unwrap();
        assert_eq!(answer.rcode, 0);
        assert!(answer.authoritative);
        assert!(
            answer.records.iter().all(|(_, ttl)| *ttl == 7),
            "{answer:?}"
        );
        // IPv4 only: AAAA is NODATA, not NXDOMAIN.
        let nodata = dns.lookup("pool.test", RecordType::Aaaa).await.unwrap();
        assert_eq!((nodata.rcode, nodata.records.len()), (0, 0));
        // Names are not case-sensitive; other names are not affected.
        assert_eq!(dns.query("POOL.test.").await.unwrap().len(), 2);
        assert_eq!(dns.query("other.test").await, Ok(vec![]));

        let changed = Instant::now();
        dns.set("pool.test", &[ip("10.1.0.3"), ip("fd00::3")]).await;
        eprintln!("new records answered after {:?}", changed.elapsed());
        assert_eq!(dns.query("pool.test").await, Ok(vec![ip("10.1.0.3")]));
        let v6 = dns.lookup("pool.test", RecordType::Aaaa).await.unwrap();
        assert_eq!(v6.addrs(), vec![ip("fd00::3")]);

        dns.set("other.test", &[ip("10.2.0.1")]).await;
        dns.set("pool.test", &[]).await;
        let gone = dns.lookup("pool.test", RecordType::A).await.unwrap();
        assert_eq!((gone.rcode, gone.records.len()), (NXDOMAIN, 0));
        assert_eq!(dns.query("other.test").await, Ok(vec![ip("10.2.0.1")]));
        assert!(dns.queries("pool.test") >= 8, "{}", dns.log());
    }

    #[tokio::test]
    async fn a_stopped_server_fails_queries_and_starts_again_as_it_was() {
        let mut dns = DnsServer::start(Duration::from_secs(1)).await;
        let addr = dns.addr();
        dns.set("backends.test", &[ip("127.0.0.2"), ip("127.0.0.3")])
            .await;

        dns.stop().await;
        assert!(!dns.running());
        let failed = dns.query("backends.test").await;
        assert!(failed.is_err(), "{failed:?}");
        eprintln!("stopped: {}", failed.unwrap_err());
        // Set while stopped: served once it is back.
        dns.set("backends.test", &[ip("127.0.0.4")]).await;

        dns.start_again().await;
        assert_eq!(dns.addr(), addr);
        assert_eq!(dns.query("backends.test").await, Ok(vec![ip("127.0.0.4")]));
        dns.set("backends.test", &[ip("127.0.0.5")]).await;
        assert_eq!(dns.query("backends.test").await, Ok(vec![ip("127.0.0.5")]));
    }

    #[tokio::test]
    async fn bad_resolvers_misbehave_as_told() {
        let garbage = BadDns::start(Misbehaviour::Garbage).await;
        let answer = lookup(garbage.addr(), "pool.test", RecordType::A).await;
        assert!(answer.is_err(), "{answer:?}");

        let silent = BadDns::start(Misbehaviour::Silent).await;
        let started = Instant::now();
        let answer = lookup(silent.addr(), "pool.test", RecordType::A).await;
        assert!(
            answer.as_ref().is_err_and(|e| e.contains("no answer")),
            "{answer:?}"
        );
        assert!(started.elapsed() >= QUERY_TIMEOUT);

        let servfail = BadDns::start(Misbehaviour::ServFail).await;
        let answer = lookup(servfail.addr(), "pool.test", RecordType::Aaaa).await;
        assert_eq!(
            answer,
            Ok(Answer {
                rcode: 2,
                authoritative: false,
                records: vec![]
            })
        );

        let addr = servfail.addr();
        drop(servfail);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(lookup(addr, "pool.test", RecordType::A).await.is_err());
    }

    #[test]
    fn a_query_is_encoded_and_an_answer_parsed_by_hand() {
        let query = encode_query(0x1234, "a.b.", RecordType::A).unwrap();
        assert_eq!(
            query,
            [0x12, 0x34, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 1, b'a', 1, b'b', 0, 0, 1, 0, 1]
        );
        assert!(encode_query(1, "a..b", RecordType::A).is_err());
        // An answer to it: one A record whose name points back at the question.
        let mut answer = query.clone();
        answer[2..4].copy_from_slice(&[0x85, 0x80]);
        answer[6..8].copy_from_slice(&[0, 1]);
        answer.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1, 0, 0, 0, 30, 0, 4, 10, 0, 0, 9]);
        assert_eq!(
            parse_answer(0x1234, &answer),
            Ok(Answer {
                rcode: 0,
                authoritative: true,
                records: vec![(ip("10.0.0.9"), 30)]
            })
        );
        assert!(parse_answer(0x1235, &answer).is_err());
        assert!(parse_answer(0x1234, &answer[..answer.len() - 1]).is_err());
        assert!(parse_answer(0x1234, &garbage(&query)).is_err());
    }

    #[tokio::test]
    async fn simulators_share_one_port_on_several_loopback_addresses() {
        let (port, sims) = sims_on_loopbacks(3, "m").await;
        let addrs: Vec<SocketAddr> = sims.iter().map(vllm_sim::Sim::addr).collect();
        assert_eq!(
            addrs,
            (2..5)
                .map(|last| SocketAddr::from(([127, 0, 0, last], port)))
                .collect::<Vec<_>>()
        );
        for sim in &sims {
            let models = crate::client()
                .get(format!("{}/v1/models", sim.url()))
                .send()
                .await
                .unwrap();
            assert!(models.status().is_success());
        }
    }
}
