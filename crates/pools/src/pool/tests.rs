// Test code: a panic is a failed test.
use super::*;
use crate::health::{HealthPolicy, Load, OutlierPolicy, StaleAs, Verdict};
use crate::prefix::PrefixKeys;
use std::collections::BTreeSet;

fn spec(port: u16, weight: usize) -> BackendSpec {
    let resolved: SocketAddr = ([127, 0, 0, 1], port).into();
    BackendSpec {
        address: resolved.to_string(),
        resolved,
        weight,
    }
}

fn pool(backends: Vec<BackendSpec>, balancing: Balancing) -> Pool {
    Pool::new(PoolSettings {
        balancing,
        ..PoolSettings::new("p", vec!["m".into()], backends)
    })
}

/// The live state of the backend at `addr`.
fn live_of(pool: &Pool, addr: SocketAddr) -> Arc<BackendLive> {
    Arc::clone(&pool.members().find(addr).unwrap().live)
}

fn load(kv: f64, waiting: f64) -> Load {
    Load {
        kv_usage: Some(kv),
        running: 1.0,
        waiting,
        kv_capacity_tokens: Some(100_000),
        spec_acceptance: None,
        lora: None,
        computed_prompt_tokens: None,
        engine: None,
        scraped_at: std::time::Instant::now(),
    }
}

/// Backend `port` of `pool` lists `adapters`, and runs `active` of its `max_loras` slots.
fn serve_adapters(pool: &Pool, port: u16, adapters: &[&str], active: &[&str], max_loras: u32) {
    let live = live_of(pool, spec(port, 1).resolved);
    let names: Vec<String> = adapters.iter().map(|a| a.to_string()).collect();
    live.publish_models(names.clone(), names);
    pool.learn_adapters();
    live.publish_load(Load {
        lora: Some(crate::health::LoraSlots {
            max_loras,
            active: active.iter().map(|a| a.to_string()).collect(),
        }),
        ..load(0.1, 0.0)
    });
}

#[test]
fn an_adapters_requests_go_where_it_is_listed_and_can_run_now() {
    for balancing in [
        Balancing::RoundRobin,
        Balancing::KvAware {
            prefix_affinity: None,
        },
        Balancing::Ttft(TtftBalancing {
            exploration: 0.0,
            ..TtftBalancing::default()
        }),
    ] {
        let pool = pool(vec![spec(1, 1), spec(2, 1), spec(3, 1)], balancing.clone());
        let ports = |adapter: Option<&str>| -> BTreeSet<u16> {
            (0..40)
                .filter_map(|_| pool.select_prefixed(&[], &Demand::default(), None, adapter))
                .map(|s| s.addr.port())
                .collect()
        };
        // Nothing known of adapters yet: any backend.
        assert_eq!(pool.adapter(Some("sql")), None);
        serve_adapters(&pool, 1, &["sql"], &["poet"], 1);
        serve_adapters(&pool, 2, &["sql", "poet"], &[], 1);
        serve_adapters(&pool, 3, &["poet"], &[], 2);
        assert_eq!(pool.adapter(Some("sql")), Some("sql"));
        assert_eq!(
            pool.adapter(Some("m")),
            None,
            "the base model is no adapter"
        );
        // `sql`: 3 lacks it, 1's only slot holds `poet`: 2, which has a free slot.
        assert_eq!(ports(Some("sql")), BTreeSet::from([2]), "{balancing:?}");
        // Every slot holding another adapter: it waits there rather than going where the
        // adapter is not.
        serve_adapters(&pool, 2, &["sql", "poet"], &["poet"], 1);
        assert_eq!(ports(Some("sql")), BTreeSet::from([1, 2]), "{balancing:?}");
        // Tried where it is listed: nowhere left.
        let tried = [spec(1, 1).resolved, spec(2, 1).resolved];
        assert!(pool
            .select_prefixed(&tried, &Demand::default(), None, Some("sql"))
            .is_none());
        // Requests without an adapter go anywhere.
        assert_eq!(ports(None), BTreeSet::from([1, 2, 3]), "{balancing:?}");
    }
}

#[test]
fn a_backend_running_the_adapter_is_preferred_to_one_loading_it() {
    for balancing in [
        Balancing::KvAware {
            prefix_affinity: None,
        },
        Balancing::Ttft(TtftBalancing {
            exploration: 0.0,
            ..TtftBalancing::default()
        }),
    ] {
        let pool = pool(vec![spec(1, 1), spec(2, 1)], balancing.clone());
        serve_adapters(&pool, 1, &["sql", "poet"], &[], 2);
        serve_adapters(&pool, 2, &["sql", "poet"], &["poet"], 2);
        for _ in 0..20 {
            let picked = pool.select_prefixed(&[], &Demand::default(), None, Some("poet"));
            assert_eq!(picked.unwrap().addr.port(), 2, "{balancing:?}");
        }
    }
}

#[test]
fn round_robin_respects_weights_and_exclusions() {
    let pool = pool(vec![spec(1, 1), spec(2, 3)], Balancing::RoundRobin);
    let none = Demand::default();
    let picks: Vec<u16> = (0..8)
        .map(|_| pool.select(&[], &none).unwrap().addr.port())
        .collect();
    assert_eq!(picks.iter().filter(|p| **p == 2).count(), 6, "{picks:?}");
    let only_other = pool.select(&[spec(2, 3).resolved], &none).unwrap();
    assert_eq!(only_other.addr.port(), 1);
    assert!(pool
        .select(&[spec(1, 1).resolved, spec(2, 3).resolved], &none)
        .is_none());
}

#[test]
fn unusable_backends_are_never_selected() {
    for balancing in [
        Balancing::RoundRobin,
        Balancing::KvAware {
            prefix_affinity: None,
        },
        Balancing::Ttft(TtftBalancing::default()),
    ] {
        let pool = pool(vec![spec(1, 1), spec(2, 1), spec(3, 1)], balancing);
        let policy = HealthPolicy {
            unhealthy_after: 1,
            ..HealthPolicy::default()
        };
        pool.live_at(0).unwrap().record_probe(false, &policy);
        let outlier = OutlierPolicy {
            consecutive_failures: 1,
            ..OutlierPolicy::default()
        };
        pool.live_at(2).unwrap().record(Verdict::Failure, &outlier);
        for _ in 0..20 {
            let picked = pool.select(&[], &Demand::default()).unwrap();
            assert_eq!(picked.addr.port(), 2);
        }
        assert!(pool
            .select(&[spec(2, 1).resolved], &Demand::default())
            .is_none());
        assert_eq!(pool.pressure().usable, 1);
    }
}

#[test]
fn kv_aware_prefers_free_cache_and_spreads_a_burst() {
    let pool = pool(
        vec![spec(1, 1), spec(2, 1), spec(3, 1)],
        Balancing::KvAware {
            prefix_affinity: None,
        },
    );
    pool.live_at(0).unwrap().publish_load(load(0.9, 4.0));
    pool.live_at(1).unwrap().publish_load(load(0.2, 0.0));
    pool.live_at(2).unwrap().publish_load(load(0.25, 0.0));
    let demand = Demand {
        prompt_tokens: 500,
        output_tokens: 500,
        affinity: None,
        sequences: 1,
        session: None,
    };
    let mut guards = Vec::new();
    let mut counts = [0usize; 3];
    for _ in 0..40 {
        let s = pool.select(&[], &demand).unwrap();
        counts[usize::from(s.addr.port()) - 1] += 1;
        guards.push(s.live.begin(demand.tokens()));
    }
    // The busy backend gets nothing; the two free ones share the burst, because what
    // was sent since the scrape counts.
    assert_eq!(counts[0], 0, "{counts:?}");
    assert!(counts[1] >= 12 && counts[2] >= 12, "{counts:?}");
    let p = pool.pressure().kv_usage.unwrap();
    assert!(p > 0.55, "the burst shows in the pressure: {p}"); // 0.45 before
}

#[test]
fn a_request_that_does_not_fit_goes_where_it_fits() {
    let pool = pool(
        vec![spec(1, 1), spec(2, 1)],
        Balancing::KvAware {
            prefix_affinity: None,
        },
    );
    pool.live_at(0).unwrap().publish_load(load(0.7, 0.0)); // 30,000 tokens free
    pool.live_at(1).unwrap().publish_load(load(0.6, 3.0)); // 40,000 free, but a queue
    let small = Demand {
        prompt_tokens: 100,
        output_tokens: 100,
        affinity: None,
        sequences: 1,
        session: None,
    };
    let big = Demand {
        prompt_tokens: 30_000,
        output_tokens: 5_000,
        affinity: None,
        sequences: 1,
        session: None,
    };
    assert_eq!(pool.select(&[], &small).unwrap().addr.port(), 1);
    assert_eq!(pool.select(&[], &big).unwrap().addr.port(), 2);
}

#[test]
fn prefix_affinity_is_sticky_unless_the_backend_is_busy() {
    let pool = pool(
        vec![spec(1, 1), spec(2, 1), spec(3, 1), spec(4, 1)],
        Balancing::KvAware {
            prefix_affinity: Some(256),
        },
    );
    for live in pool.members().iter().map(|e| &e.live) {
        live.publish_load(load(0.3, 0.0));
    }
    let demand = Demand {
        prompt_tokens: 10,
        output_tokens: 10,
        affinity: Some(42),
        sequences: 1,
        session: None,
    };
    let home = pool.select(&[], &demand).unwrap().addr;
    for _ in 0..20 {
        assert_eq!(pool.select(&[], &demand).unwrap().addr, home);
    }
    live_of(&pool, home).publish_load(load(0.95, 8.0));
    for _ in 0..20 {
        assert_ne!(pool.select(&[], &demand).unwrap().addr, home);
    }
}

/// A pool of three with an exact prefix index in which backend 2 holds `tokens`.
fn indexed_pool(tokens: &[u32], exploration: f64) -> Pool {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/tokenizer-chatml");
    let tokenizer = sluice_tokenizer::PromptTokenizer::load(&dir).unwrap();
    let routing = Arc::new(PrefixRouting::new(
        Arc::new(tokenizer),
        crate::prefix::KvEventSource::Port(1),
    ));
    routing.index.apply(
        spec(2, 1).resolved,
        &[crate::prefix_index::KvEvent::Stored {
            hashes: (0..tokens.len() as u64 / 16).collect(),
            parent: None,
            token_ids: tokens.to_vec(),
            block_size: 16,
            extra: Vec::new(),
        }],
    );
    Pool::new(PoolSettings {
        balancing: Balancing::Ttft(TtftBalancing {
            prefix_affinity: None,
            prefill_tokens_per_second: 1_000.0,
            exploration,
        }),
        prefix: Some(routing),
        ..PoolSettings::new(
            "p",
            vec!["m".into()],
            vec![spec(1, 1), spec(2, 1), spec(3, 1)],
        )
    })
}

#[test]
fn the_exact_index_sends_a_prompt_where_it_is_held_and_never_explores_away() {
    let tokens: Vec<u32> = (0..1024).collect();
    let keys = PrefixKeys {
        keys: crate::prefix_index::block_keys(&tokens, 16, None, None),
        tokens: 1030,
    };
    let demand = prompt(1030, None);
    // Even exploring every request: the held prompt goes where it is held.
    let pool = indexed_pool(&tokens, 1.0);
    for _ in 0..30 {
        let s = pool
            .select_prefixed(&[], &demand, Some(&keys), None)
            .unwrap();
        assert_eq!(s.addr.port(), 2);
        assert_eq!(s.predicted_cached, Some(1024));
        assert_eq!(s.cached_tokens, Some(1024));
    }
    // Another prompt, held nowhere: explored, spread over the three.
    let other: Vec<u32> = (5000..6024).collect();
    let keys = PrefixKeys {
        keys: crate::prefix_index::block_keys(&other, 16, None, None),
        tokens: 1024,
    };
    let ports: std::collections::HashSet<u16> = (0..60)
        .map(|_| {
            pool.select_prefixed(&[], &demand, Some(&keys), None)
                .unwrap()
                .addr
                .port()
        })
        .collect();
    assert_eq!(ports.len(), 3, "{ports:?}");
    // Busy enough, the holder is left: its queue costs more than the prefill it saves.
    let pool = indexed_pool(&tokens, 0.0);
    let holder = pool.live_at(1).unwrap();
    let _queue: Vec<_> = (0..4).map(|_| holder.begin_request(3000, 3000)).collect();
    let s = pool
        .select_prefixed(&[], &demand, Some(&keys_of(&tokens)), None)
        .unwrap();
    assert_ne!(
        s.addr.port(),
        2,
        "12,000 tokens queued there outweigh 1,024 cached"
    );
    assert_eq!(s.cached_tokens, Some(0));
}

fn keys_of(tokens: &[u32]) -> PrefixKeys {
    PrefixKeys {
        keys: crate::prefix_index::block_keys(tokens, 16, None, None),
        tokens: tokens.len() + 6,
    }
}

fn ttft(prefix_affinity: Option<usize>) -> Balancing {
    Balancing::Ttft(TtftBalancing {
        prefix_affinity,
        prefill_tokens_per_second: 1_000.0,
        exploration: 0.0,
    })
}

fn prompt(tokens: u64, affinity: Option<u64>) -> Demand {
    Demand {
        prompt_tokens: tokens,
        output_tokens: 10,
        affinity,
        sequences: 1,
        session: None,
    }
}

#[test]
fn ttft_avoids_a_backend_busy_prefilling() {
    let pool = pool(vec![spec(1, 1), spec(2, 1), spec(3, 1)], ttft(None));
    let busy = pool.live_at(1).unwrap().begin_request(20_000, 16_000);
    let mut queued = pool.live_at(2).unwrap().begin_request(5_000, 3_000);
    for _ in 0..20 {
        let s = pool.select(&[], &prompt(100, None)).unwrap();
        assert_eq!(s.addr.port(), 1);
        assert!((s.predicted_ttft.unwrap() - 0.1).abs() < 1e-9);
    }
    // Once its prefill is over, the third is as good as the first: ties rotate.
    queued.first_byte(false); // Not a first token: nothing learned of its speed.
    drop(queued);
    let ports: BTreeSet<u16> = (0..40)
        .map(|_| pool.select(&[], &prompt(100, None)).unwrap().addr.port())
        .collect();
    assert!(ports.contains(&1) && ports.contains(&3), "{ports:?}");
    assert_eq!(
        pool.select(&[spec(1, 1).resolved], &prompt(100, None))
            .unwrap()
            .addr
            .port(),
        3,
        "tried backends are left out"
    );
    drop(busy);
}

#[test]
fn ttft_explores_a_share_of_requests_only_where_nothing_is_ahead() {
    let pool = pool(
        vec![spec(1, 1), spec(2, 1), spec(3, 1)],
        Balancing::Ttft(TtftBalancing {
            exploration: 0.5,
            ..TtftBalancing::default()
        }),
    );
    // 1 is idle but predicted slower than 2 (many sequences decoding share its steps); 3
    // has just taken a long prompt, which a request explored there would wait behind.
    pool.live_at(0).unwrap().publish_load(Load {
        running: 200.0,
        ..load(0.1, 0.0)
    });
    let long = pool.live_at(2).unwrap().begin_request(200_000, 100_000);
    let picks: Vec<u16> = (0..400)
        .map(|_| pool.select(&[], &prompt(100, None)).unwrap().addr.port())
        .collect();
    let to = |port: u16| picks.iter().filter(|&&p| p == port).count();
    // Half the requests explore, half of those the slower idle backend; none goes behind
    // the long prefill.
    assert!((50..=150).contains(&to(1)), "{picks:?}");
    assert_eq!(to(3), 0, "explored behind a long prefill");
    assert_eq!(pool.live_at(0).unwrap().speed_samples(), 0);
    // With something ahead everywhere, nothing is explored: each request goes where it is
    // predicted to start first (2: 1,000 tokens ahead, against 1's 100 and 200 decodes).
    let small = pool.live_at(0).unwrap().begin_request(200, 100);
    let medium = pool.live_at(1).unwrap().begin_request(2_000, 1_000);
    for _ in 0..100 {
        let picked = pool.select(&[], &prompt(100, None)).unwrap().addr.port();
        assert_eq!(picked, 2, "explored with nothing idle");
    }
    drop((long, small, medium));
}

#[test]
fn ttft_keeps_prefix_affinity_while_the_cache_saves_more_than_the_wait() {
    let pool = pool(vec![spec(1, 1), spec(2, 1), spec(3, 1)], ttft(Some(256)));
    let shared = prompt(2_000, Some(7));
    let home = pool.select(&[], &shared).unwrap().addr;
    for _ in 0..10 {
        assert_eq!(
            pool.select(&[], &shared).unwrap().addr,
            home,
            "idle: sticky"
        );
    }
    // 500 tokens ahead cost 0.5 s, less than the 1,000 cached tokens save: it stays.
    let small = live_of(&pool, home).begin_request(600, 500);
    assert_eq!(pool.select(&[], &shared).unwrap().addr, home);
    // 5,000 ahead cost more than the cache saves: it goes elsewhere.
    let long = live_of(&pool, home).begin_request(6_000, 5_000);
    for _ in 0..10 {
        assert_ne!(pool.select(&[], &shared).unwrap().addr, home);
    }
    drop((small, long));
    assert_eq!(pool.select(&[], &shared).unwrap().addr, home, "back home");
}

#[test]
fn ttft_sends_nothing_where_the_kv_cache_is_full() {
    let pool = pool(vec![spec(1, 1), spec(2, 1)], ttft(None));
    pool.live_at(0).unwrap().publish_load(load(0.999, 0.0));
    pool.live_at(1).unwrap().publish_load(load(0.1, 0.0));
    let _backlog = pool.live_at(1).unwrap().begin_request(2_000, 1_000); // 1 s of prefill
    assert_eq!(pool.select(&[], &prompt(500, None)).unwrap().addr.port(), 2);
}

fn sessions(mode: SessionMode, capacity: usize) -> Pool {
    sessions_by(
        mode,
        capacity,
        vec![SessionKey::Header("x-session-id".into())],
    )
}

fn sessions_by(mode: SessionMode, capacity: usize, keys: Vec<SessionKey>) -> Pool {
    Pool::new(PoolSettings {
        balancing: ttft(None),
        sessions: Some(SessionAffinity {
            keys,
            mode,
            idle_ttl: Duration::from_secs(600),
            capacity,
        }),
        ..PoolSettings::new(
            "p",
            vec!["m".into()],
            vec![spec(1, 1), spec(2, 1), spec(3, 1)],
        )
    })
}

/// A chat request with `body`'s members beside its one message.
fn call_with(members: &str) -> LlmCall {
    let body = format!(r#"{{"messages":[{{"role":"user","content":"hi"}}]{members}}}"#);
    LlmCall::parse(
        sluice_llm::Endpoint::ChatCompletions,
        bytes::Bytes::from(body),
    )
    .unwrap()
}

/// A turn of 1,000 prompt tokens of the session `id` (its header).
fn in_session(pool: &Pool, id: &str) -> Demand {
    let mut header = pingora_http::RequestHeader::build("POST", b"/", None).unwrap();
    header.insert_header("x-session-id", id).unwrap();
    Demand {
        session: pool.session_key(&header, &call_with(""), None),
        ..prompt(1_000, None)
    }
}

#[test]
fn a_session_stays_on_its_backend() {
    for mode in [SessionMode::Soft, SessionMode::Hard] {
        let pool = sessions(mode, 1_024);
        let demand = in_session(&pool, "conversation-1");
        assert!(demand.session.is_some());
        let home = pool.select(&[], &demand).unwrap().addr;
        // Its backend gets busier than the others, but what the session left there saves
        // more than the wait costs: it stays.
        let _a = live_of(&pool, home).begin_request(400, 300);
        for _ in 0..10 {
            assert_eq!(pool.select(&[], &demand).unwrap().addr, home, "{mode:?}");
        }
        // Not when it is tried already, or unusable.
        assert_ne!(pool.select(&[home], &demand).unwrap().addr, home);
        assert_eq!(pool.sessions_remembered(), 1);
    }
    let pool = sessions(SessionMode::Soft, 1_024);
    let call = call_with("");
    let mut header = pingora_http::RequestHeader::build("POST", b"/", None).unwrap();
    assert_eq!(
        pool.session_key(&header, &call, None),
        None,
        "no header: no session"
    );
    header.insert_header("x-session-id", "").unwrap();
    assert_eq!(pool.session_key(&header, &call, None), None);
    // One tenant's session id is not another's session (N21).
    header.insert_header("x-session-id", "shared-id").unwrap();
    let alpha = pool.session_key(&header, &call, Some("alpha"));
    assert!(alpha.is_some());
    assert_eq!(alpha, pool.session_key(&header, &call, Some("alpha")));
    assert_ne!(alpha, pool.session_key(&header, &call, Some("beta")));
    assert_ne!(alpha, pool.session_key(&header, &call, None));
}

#[test]
fn a_session_is_read_from_the_first_key_that_names_it() {
    let keys = vec![
        SessionKey::Header("x-claude-code-session-id".into()),
        SessionKey::Body {
            member: "prompt_cache_key",
            inner: None,
        },
        SessionKey::Body {
            member: "metadata",
            inner: Some("user_id".into()),
        },
    ];
    let pool = sessions_by(SessionMode::Soft, 1_024, keys);
    let bare = pingora_http::RequestHeader::build("POST", b"/", None).unwrap();
    let key = |header: &pingora_http::RequestHeader, members: &str| {
        pool.session_key(header, &call_with(members), Some("t"))
    };
    // Codex's prompt_cache_key; Anthropic's metadata.user_id; neither; both (the first
    // listed wins).
    let codex = key(&bare, r#","prompt_cache_key":"019ee74f-22b5""#);
    assert!(codex.is_some());
    assert_eq!(
        codex,
        key(
            &bare,
            r#","temperature":0,"prompt_cache_key":"019ee74f-22b5""#
        )
    );
    let claude = key(
        &bare,
        r#","metadata":{"user_id":"user_ab_account__session_7f"}"#,
    );
    assert!(claude.is_some());
    assert_ne!(claude, codex);
    assert_eq!(
        key(
            &bare,
            r#","metadata":{"user_id":null},"prompt_cache_key":"""#
        ),
        None
    );
    assert_eq!(key(&bare, r#","metadata":"user_id""#), None);
    assert_eq!(
        key(
            &bare,
            r#","metadata":{"user_id":"user_ab_account__session_7f"},"prompt_cache_key":"019ee74f-22b5""#
        ),
        codex
    );
    // The header comes first.
    let mut header = bare.clone();
    header
        .insert_header("x-claude-code-session-id", "7f")
        .unwrap();
    let by_header = key(&header, r#","prompt_cache_key":"019ee74f-22b5""#);
    assert!(by_header.is_some());
    assert_ne!(by_header, codex);
    assert_eq!(by_header, key(&header, ""));
    // A key escaped in the body (not placed by the parse) is still read.
    assert_eq!(
        codex,
        key(&bare, r#","prompt_cache_k\u0065y":"019ee74f-22b5""#)
    );
}

#[test]
fn a_session_turn_moves_only_when_the_wait_costs_more_than_the_recompute() {
    let pool = sessions(SessionMode::Soft, 1_024);
    let demand = in_session(&pool, "agent-1");
    let home = pool.select(&[], &demand).unwrap().addr;
    // 900 tokens of others' prefill ahead at home: less than the 1,000 a move recomputes.
    let ahead = live_of(&pool, home).begin_request(1_000, 900);
    let stays = pool.select(&[], &demand).unwrap();
    assert_eq!(stays.addr, home);
    let (runner_up, its_ttft) = stays.runner_up.expect("ttft names the runner-up");
    assert_ne!(runner_up, home);
    assert!(stays.predicted_ttft.unwrap() < its_ttft, "{stays:?}");
    assert!(!stays.session_moved);
    // 1,100 ahead: more than the recompute, so it moves, and the session with it.
    let more = live_of(&pool, home).begin_request(300, 200);
    let moved = pool.select(&[], &demand).unwrap();
    assert_ne!(moved.addr, home);
    assert!(moved.session_moved);
    assert_eq!(pool.select(&[], &demand).unwrap().addr, moved.addr);
    drop((ahead, more));
}

#[test]
fn a_soft_session_leaves_an_overloaded_backend_and_a_hard_one_does_not() {
    for (mode, stays) in [(SessionMode::Soft, false), (SessionMode::Hard, true)] {
        let pool = sessions(mode, 1_024);
        let demand = in_session(&pool, "conversation-2");
        let home = pool.select(&[], &demand).unwrap().addr;
        // Five seconds of prefill queued ahead.
        let _backlog = live_of(&pool, home).begin_request(6_000, 5_000);
        let next = pool.select(&[], &demand).unwrap().addr;
        assert_eq!(next == home, stays, "{mode:?}");
        // A soft session moved with the request: it stays where it went.
        assert_eq!(pool.select(&[], &demand).unwrap().addr, next, "{mode:?}");
        // A full KV cache is overload too.
        let pool = sessions(mode, 1_024);
        let home = pool.select(&[], &demand).unwrap().addr;
        live_of(&pool, home).publish_load(load(0.999, 0.0));
        assert_eq!(pool.select(&[], &demand).unwrap().addr == home, stays);
    }
}

#[test]
fn the_session_table_is_bounded() {
    let pool = sessions(SessionMode::Hard, 64);
    for i in 0..10_000 {
        let demand = in_session(&pool, &format!("client-chosen-{i}"));
        pool.select(&[], &demand).unwrap();
    }
    assert!(pool.sessions_remembered() <= 64);
    // The latest sessions are still remembered (each evicts only older ones).
    let demand = in_session(&pool, "client-chosen-9999");
    let home = pool.select(&[], &demand).unwrap().addr;
    let _busy = pool
        .members()
        .find(home)
        .unwrap()
        .live
        .begin_request(60_000, 50_000);
    assert_eq!(pool.select(&[], &demand).unwrap().addr, home);
}

#[test]
fn no_more_than_the_configured_share_of_a_pool_is_ejected() {
    let pool = pool(
        vec![spec(1, 1), spec(2, 1), spec(3, 1), spec(4, 1)],
        Balancing::RoundRobin,
    );
    let outlier = OutlierPolicy {
        consecutive_failures: 1,
        ..OutlierPolicy::default()
    };
    for live in pool.members().iter().map(|e| &e.live) {
        live.record_in_pool(Verdict::Failure, &outlier, pool.may_eject_another());
    }
    let ejected = pool
        .members()
        .iter()
        .filter(|e| e.live.is_ejected())
        .count();
    assert_eq!(ejected, 2, "50% of 4");
    let one = self::pool(vec![spec(1, 1)], Balancing::RoundRobin);
    assert!(one.may_eject_another(), "one backend may always be ejected");
}

/// A pool of a backend with fresh metrics at `kv` and one alive without any, its balancer
/// counting stale backends as `stale_as` says.
fn pool_with_a_stale_backend(kv: f64, stale_as: StaleAs) -> Pool {
    let pool = Pool::new(PoolSettings {
        health: HealthPolicy {
            stale_as,
            ..HealthPolicy::default()
        },
        ..PoolSettings::new("p", vec!["m".into()], vec![spec(1, 1), spec(2, 1)])
    });
    for live in pool.members().iter().map(|e| &e.live) {
        live.record_probe(true, &pool.settings.health);
    }
    pool.live_at(0).unwrap().publish_load(load(kv, 0.0));
    pool
}

#[test]
fn pressure_leaves_stale_backends_to_the_reader() {
    for stale_as in [StaleAs::Saturated, StaleAs::Unknown] {
        // The pool's `stale_as` is the balancer's: the pressure is the same either way.
        let pressure = pool_with_a_stale_backend(0.5, stale_as).pressure();
        assert_eq!(pressure.kv_usage, Some(0.5), "fresh backends only");
        assert_eq!(
            (pressure.usable, pressure.measured, pressure.stale),
            (2, 1, 1)
        );
        assert_eq!(pressure.kv_capacity_tokens, Some(100_000.0));
        assert_eq!(
            pressure.kv_usage_counting_stale(StaleAs::Saturated),
            Some(0.75),
            "a stale backend counts as a full one of average size"
        );
        assert_eq!(
            pressure.kv_usage_counting_stale(StaleAs::Unknown),
            Some(0.5)
        );
    }

    // Every backend stale: nothing known, unless stale counts as full.
    let pool = pool_with_a_stale_backend(0.5, StaleAs::Saturated);
    pool.live_at(0).unwrap().publish_load(Load {
        scraped_at: std::time::Instant::now() - Duration::from_secs(60),
        ..load(0.5, 0.0)
    });
    let pressure = pool.pressure();
    assert_eq!((pressure.kv_usage, pressure.stale), (None, 2));
    assert_eq!(pressure.kv_capacity_tokens, None);
    assert_eq!(pressure.with_demand(1_000), None);
    assert_eq!(
        pressure.kv_usage_counting_stale(StaleAs::Saturated),
        Some(1.0)
    );
    assert_eq!(pressure.kv_usage_counting_stale(StaleAs::Unknown), None);
}

#[test]
fn the_balancer_applies_the_pools_stale_as() {
    let demand = Demand {
        prompt_tokens: 10,
        output_tokens: 10,
        affinity: None,
        sequences: 1,
        session: None,
    };
    // Saturated: the stale backend looks full, so the fresh one, 60 % used, wins.
    let pool = pool_with_a_stale_backend(0.6, StaleAs::Saturated);
    for _ in 0..20 {
        assert_eq!(pool.select(&[], &demand).unwrap().addr.port(), 1);
    }
    // Unknown: it is balanced by what is in flight there (nothing), which beats 60 %.
    let pool = pool_with_a_stale_backend(0.6, StaleAs::Unknown);
    for _ in 0..20 {
        assert_eq!(pool.select(&[], &demand).unwrap().addr.port(), 2);
    }
}

/// Sheds above a fixed line, reading the pool's pressure on every call.
struct Line(f64);

impl Admission for Line {
    fn sheds(&self, pool: &Pool, _priority: Priority) -> bool {
        pool.pressure().kv_usage.is_some_and(|kv| kv >= self.0)
    }
    fn admits(&self, pool: &Pool, priority: Priority, _tokens: u64) -> bool {
        !self.sheds(pool, priority)
    }
}

#[test]
fn admission_is_asked_of_the_pool_and_follows_its_load() {
    let pool = pool(vec![spec(1, 1)], Balancing::RoundRobin);
    pool.live_at(0).unwrap().publish_load(load(0.9, 0.0));
    assert!(pool.admits(Priority::Sheddable, 100), "no gate: everything");
    assert!(!pool.sheds(Priority::Sheddable));
    assert!(pool.install_admission(Arc::new(Line(0.8))));
    assert!(
        !pool.install_admission(Arc::new(Line(0.5))),
        "one gate only"
    );
    assert!(pool.sheds(Priority::Standard));
    assert!(!pool.admits(Priority::Standard, 100));
    pool.live_at(0).unwrap().publish_load(load(0.1, 0.0));
    assert!(!pool.sheds(Priority::Standard));
    assert!(pool.admits(Priority::Standard, 100));
    assert_eq!(Priority::parse(" Critical"), Some(Priority::Critical));
    assert_eq!(Priority::parse("vip"), None);
}

#[test]
fn total_timeout_is_sized_by_max_tokens_and_capped() {
    let t = Timeouts {
        first_byte: Duration::from_secs(10),
        total: Duration::from_secs(100),
        sized_by_max_tokens: Some(TokensPerSecond {
            min_tokens_per_second: 10.0,
            margin: Duration::from_secs(5),
        }),
        ..Timeouts::default()
    };
    assert_eq!(t.total_for(Some(200)), Duration::from_secs(35));
    assert_eq!(t.total_for(Some(100_000)), Duration::from_secs(100));
    assert_eq!(t.total_for(None), Duration::from_secs(100));
    let tiny = Timeouts {
        sized_by_max_tokens: Some(TokensPerSecond {
            min_tokens_per_second: 1e-300,
            margin: Duration::MAX,
        }),
        ..t
    };
    assert_eq!(tiny.total_for(Some(u32::MAX)), Duration::from_secs(100));
}

fn wanted(port: u16, ready: bool) -> Wanted {
    Wanted {
        spec: spec(port, 1),
        ready,
    }
}

#[test]
fn a_joiner_gets_a_small_share_until_scraped_and_a_drainer_none() {
    for balancing in [
        Balancing::RoundRobin,
        Balancing::KvAware {
            prefix_affinity: None,
        },
        Balancing::Ttft(TtftBalancing::default()),
    ] {
        let pool = pool(vec![spec(1, 1)], balancing);
        pool.update(&[wanted(1, true), wanted(2, true)]);
        // The newcomer takes one request at a time while nothing is known of it...
        let mut held = Vec::new();
        for _ in 0..20 {
            let picked = pool.select(&[], &Demand::default()).unwrap();
            held.push(picked.live.begin(10));
        }
        let on_new = |pool: &Pool| {
            pool.members()
                .find(spec(2, 1).resolved)
                .unwrap()
                .live
                .in_flight()
        };
        assert_eq!(on_new(&pool), 1, "{:?}", pool.settings.balancing);
        // ...but is not starved when it is all there is.
        let only = pool.select(&[spec(1, 1).resolved], &Demand::default());
        assert_eq!(only.unwrap().addr, spec(2, 1).resolved);
        // Scraped, it is balanced as any other.
        pool.members()
            .find(spec(2, 1).resolved)
            .unwrap()
            .live
            .publish_load(load(0.0, 0.0));
        assert!(pool.members().get(1).unwrap().warming_cap().is_none());
        drop(held);

        // Draining: no new request, even when it is the only backend left.
        pool.update(&[wanted(1, true), wanted(2, false)]);
        for _ in 0..10 {
            assert_eq!(pool.select(&[], &Demand::default()).unwrap().addr.port(), 1);
        }
        assert!(pool
            .select(&[spec(1, 1).resolved], &Demand::default())
            .is_none());
        assert_eq!(pool.pressure().usable, 1);
        // Nothing runs there: the next sweep lets it go.
        assert_eq!(pool.sweep(), vec![spec(2, 1).address]);
        assert_eq!(pool.members().len(), 1);
    }
}

#[test]
fn a_session_and_a_prefix_home_survive_an_update_that_keeps_their_backend() {
    let mut settings = PoolSettings::new("p", vec!["m".into()], vec![spec(1, 1), spec(2, 1)]);
    settings.balancing = Balancing::KvAware {
        prefix_affinity: Some(64),
    };
    settings.sessions = Some(SessionAffinity {
        keys: vec![SessionKey::Header("x-session-id".into())],
        mode: SessionMode::Hard,
        idle_ttl: Duration::from_secs(60),
        capacity: 64,
    });
    let pool = Pool::new(settings);
    let session = Demand {
        session: Some(42),
        ..Demand::default()
    };
    let home = pool.select(&[], &session).unwrap().addr;
    // Two backends join (before it, in the list) and the other one leaves.
    let other = if home.port() == 1 { 2 } else { 1 };
    let mut next = vec![wanted(7, true), wanted(8, true), wanted(home.port(), true)];
    next.retain(|w| w.spec.resolved.port() != other);
    let change = pool.update(&next);
    assert_eq!(change.joined.len(), 2);
    assert_eq!(change.left, vec![spec(other, 1).address]);
    for _ in 0..10 {
        assert_eq!(pool.select(&[], &session).unwrap().addr, home);
    }
}

#[test]
fn a_source_listing_too_many_endpoints_is_cut_at_the_limit() {
    let pool = pool(vec![], Balancing::RoundRobin);
    let many: Vec<Wanted> = (1..=5000).map(|p| wanted(p, true)).collect();
    let change = pool.update(&many);
    assert_eq!(change.over_limit, 5000 - crate::MAX_ENDPOINTS);
    assert_eq!(pool.members().len(), crate::MAX_ENDPOINTS);
    assert!(pool.select(&[], &Demand::default()).is_some());
}
