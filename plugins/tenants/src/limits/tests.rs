//! The limits end to end through the public API: locally on tokio's paused clock, shared
//! through real redis-server processes (single node and Cluster).

use super::*;
use http::HeaderName;
use sluice_sdk::Reason;
use std::time::Duration;

fn header(h: &[(HeaderName, HeaderValue)], name: &str) -> Option<String> {
    h.iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.to_str().unwrap().to_string())
}

fn rpm(n: u32) -> LimitsConfig {
    LimitsConfig {
        requests_per_minute: Some(n),
        ..LimitsConfig::default()
    }
}

fn tenant(name: &str, limits: LimitsConfig) -> (Arc<str>, LimitsConfig, BudgetConfig) {
    (name.into(), limits, BudgetConfig::default())
}

fn want(input: u64, output: u64) -> Want {
    Want {
        input_tokens: input,
        output_tokens: output,
    }
}

fn usage(input: u64, output: u64, usd: f64) -> Option<Usage> {
    Some(Usage {
        input_tokens: input,
        output_tokens: output,
        usd,
    })
}

fn local(tenants: Vec<(Arc<str>, LimitsConfig, BudgetConfig)>) -> Limiter {
    Limiter::start(&StoreConfig::default(), tenants)
}

#[test]
fn admitted_and_limiter_can_be_shared_across_tasks() {
    fn shared<T: Send + Sync + 'static>() {}
    shared::<Admitted>();
    shared::<Limiter>();
}

mod config {
    use super::*;

    #[test]
    fn a_tenant_section_is_merged_over_the_defaults_field_by_field() {
        let defaults = LimitsConfig {
            requests_per_minute: Some(60),
            output_tokens_per_minute: Some(1000),
            ..LimitsConfig::default()
        };
        let merged = rpm(5).or(&defaults);
        assert_eq!(merged.requests_per_minute, Some(5));
        assert_eq!(merged.output_tokens_per_minute, Some(1000));
        assert_eq!(merged.input_tokens_per_minute, None);
        let budget = BudgetConfig {
            mode: Some(BudgetMode::Shadow),
            ..BudgetConfig::default()
        }
        .or(&BudgetConfig {
            usd_per_day: Some(3.0),
            mode: Some(BudgetMode::Enforce),
            ..BudgetConfig::default()
        });
        assert_eq!(budget.usd_per_day, Some(3.0));
        assert_eq!(budget.mode, Some(BudgetMode::Shadow));
    }

    #[test]
    fn zero_limits_and_budgets_are_refused_with_their_key() {
        let e = rpm(0).validate("tenants.alpha.limits").unwrap_err();
        assert_eq!(e.key, "tenants.alpha.limits.requests_per_minute");
        let e = LimitsConfig {
            output_tokens_per_minute: Some(0),
            ..LimitsConfig::default()
        }
        .validate("defaults.limits")
        .unwrap_err();
        assert_eq!(e.key, "defaults.limits.output_tokens_per_minute");
        assert!(rpm(5).validate("x").is_ok());
        let e = BudgetConfig {
            usd_per_month: Some(-1.0),
            ..BudgetConfig::default()
        }
        .validate("tenants.a.budget")
        .unwrap_err();
        assert_eq!(e.key, "tenants.a.budget.usd_per_month");
        let e = BudgetConfig {
            usd_per_day: Some(f64::NAN),
            ..BudgetConfig::default()
        }
        .validate("b");
        assert!(e.is_err());
    }

    #[test]
    fn the_store_section_reads_and_checks() {
        let c: StoreConfig = serde_json::from_value(serde_json::json!({})).unwrap();
        assert_eq!(c, StoreConfig::default());
        assert_eq!(c.kind, StoreKind::Local);
        assert_eq!(c.on_redis_error, OnRedisError::Local);
        let c: StoreConfig = serde_json::from_value(serde_json::json!({
            "kind": "redis", "on_redis_error": "deny",
            "redis": {"url": "redis://127.0.0.1:6379", "timeout": "20ms"}
        }))
        .unwrap();
        assert!(c.validate().is_ok());
        let redis = c.redis.as_ref().unwrap();
        assert_eq!(redis.timeout, Duration::from_millis(20));
        assert_eq!(redis.key_prefix, "sluice:limits:");
        let missing = StoreConfig {
            kind: StoreKind::Redis,
            ..StoreConfig::default()
        };
        assert_eq!(missing.validate().unwrap_err().key, "redis");
        let both = StoreConfig {
            kind: StoreKind::Redis,
            redis: Some(RedisConfig {
                url: Some("redis://a:1".into()),
                cluster_nodes: vec!["redis://b:1".into()],
                ..RedisConfig::default()
            }),
            ..StoreConfig::default()
        };
        assert_eq!(both.validate().unwrap_err().key, "redis.url");
        let bad: Result<StoreConfig, _> =
            serde_json::from_value(serde_json::json!({"kind": "redis", "nope": 1}));
        assert!(bad.is_err());
        let mode: BudgetConfig =
            serde_json::from_value(serde_json::json!({"mode": "shadow"})).unwrap();
        assert_eq!(mode.mode, Some(BudgetMode::Shadow));
    }
}

mod local {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn the_sixth_request_in_a_minute_is_refused_with_openai_headers() {
        let limiter = local(vec![tenant("alpha", rpm(5)), tenant("beta", rpm(5))]);
        let first = limiter.admit("alpha", Want::default()).await.unwrap();
        assert_eq!(
            header(&first.headers(), "x-ratelimit-limit-requests").as_deref(),
            Some("5")
        );
        assert_eq!(
            header(&first.headers(), "x-ratelimit-remaining-requests").as_deref(),
            Some("4")
        );
        assert_eq!(
            header(&first.headers(), "x-ratelimit-reset-requests").as_deref(),
            Some("12s")
        );
        // No token limit, no token headers.
        assert_eq!(header(&first.headers(), "x-ratelimit-limit-tokens"), None);
        for _ in 0..4 {
            limiter.admit("alpha", Want::default()).await.unwrap();
        }
        let refused = limiter.admit("alpha", Want::default()).await.unwrap_err();
        assert_eq!(refused.status, 429);
        assert_eq!(refused.reason, Reason::RateLimited);
        assert_eq!(refused.retry_after, Some(12));
        assert_eq!(
            header(&refused.headers, "x-ratelimit-limit-requests").as_deref(),
            Some("5")
        );
        assert_eq!(
            header(&refused.headers, "x-ratelimit-remaining-requests").as_deref(),
            Some("0")
        );
        assert_eq!(
            header(&refused.headers, "x-ratelimit-reset-requests").as_deref(),
            Some("1m0s")
        );
        assert!(
            refused.message.contains("requests per minute"),
            "{}",
            refused.message
        );
        // Another tenant is not affected.
        limiter.admit("beta", Want::default()).await.unwrap();
        // One request's worth refills in 12 s.
        tokio::time::advance(Duration::from_secs(12)).await;
        limiter.admit("alpha", Want::default()).await.unwrap();
        assert!(limiter.admit("alpha", Want::default()).await.is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn a_tenant_not_configured_is_not_limited() {
        let limiter = local(vec![tenant("alpha", rpm(1))]);
        for _ in 0..10 {
            let a = limiter
                .admit("stranger", want(1_000_000, 1_000_000))
                .await
                .unwrap();
            assert!(a.headers().is_empty());
        }
    }

    fn tokens(input: Option<u64>, output: Option<u64>) -> LimitsConfig {
        LimitsConfig {
            input_tokens_per_minute: input,
            output_tokens_per_minute: output,
            ..LimitsConfig::default()
        }
    }

    #[tokio::test(start_paused = true)]
    async fn an_admission_over_the_token_limit_is_refused_and_a_refund_lets_the_next_in() {
        let limiter = local(vec![tenant("alpha", tokens(Some(1000), None))]);
        let big = limiter.admit("alpha", want(800, 0)).await.unwrap();
        assert_eq!(
            header(&big.headers(), "x-ratelimit-remaining-tokens").as_deref(),
            Some("200")
        );
        let refused = limiter.admit("alpha", want(300, 0)).await.unwrap_err();
        assert_eq!((refused.status, refused.reason), (429, Reason::RateLimited));
        assert_eq!(
            header(&refused.headers, "x-ratelimit-limit-tokens").as_deref(),
            Some("1000")
        );
        assert_eq!(
            header(&refused.headers, "x-ratelimit-remaining-tokens").as_deref(),
            Some("200")
        );
        assert!(
            refused.message.contains("input tokens"),
            "{}",
            refused.message
        );
        // 100 tokens more are needed: 6 s of refill.
        assert_eq!(refused.retry_after, Some(6));
        // The answer used 100 of the 800 estimated: 700 come back.
        big.settle(usage(100, 0, 0.0));
        let next = limiter.admit("alpha", want(300, 0)).await.unwrap();
        assert_eq!(
            header(&next.headers(), "x-ratelimit-remaining-tokens").as_deref(),
            Some("600")
        );
    }

    #[tokio::test(start_paused = true)]
    async fn usage_beyond_the_estimate_is_owed_and_waited_off() {
        let limiter = local(vec![tenant("alpha", tokens(None, Some(1000)))]);
        let a = limiter.admit("alpha", want(0, 10)).await.unwrap();
        a.settle(usage(0, 3000, 0.0));
        let refused = limiter.admit("alpha", want(0, 1)).await.unwrap_err();
        assert!(
            refused.message.contains("output tokens"),
            "{}",
            refused.message
        );
        // 3000 tokens of a 1000/min limit: full again in 3 min, one token fits 60.06 s before.
        assert_eq!(refused.retry_after, Some(121));
        assert_eq!(
            header(&refused.headers, "x-ratelimit-remaining-tokens").as_deref(),
            Some("0")
        );
        tokio::time::advance(Duration::from_secs(119)).await;
        assert!(limiter.admit("alpha", want(0, 1)).await.is_err());
        tokio::time::advance(Duration::from_secs(2)).await;
        limiter.admit("alpha", want(0, 1)).await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn without_usage_the_estimate_stays_charged() {
        let limiter = local(vec![tenant("alpha", tokens(Some(1000), Some(1000)))]);
        let a = limiter.admit("alpha", want(900, 10)).await.unwrap();
        a.settle(None);
        let refused = limiter.admit("alpha", want(200, 10)).await.unwrap_err();
        assert!(
            refused.message.contains("input tokens"),
            "{}",
            refused.message
        );
        // The refused admission charged nothing: the output limit still has 990.
        let ok = limiter.admit("alpha", want(100, 990)).await.unwrap();
        // Both buckets are now empty; the headers report one of them at 0.
        assert_eq!(
            header(&ok.headers(), "x-ratelimit-remaining-tokens").as_deref(),
            Some("0")
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_token_headers_report_the_limit_nearest_exhaustion() {
        let limiter = local(vec![tenant("alpha", tokens(Some(10_000), Some(100)))]);
        let a = limiter.admit("alpha", want(1000, 90)).await.unwrap();
        assert_eq!(
            header(&a.headers(), "x-ratelimit-limit-tokens").as_deref(),
            Some("100")
        );
        assert_eq!(
            header(&a.headers(), "x-ratelimit-remaining-tokens").as_deref(),
            Some("10")
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_refused_by_tokens_costs_no_request() {
        let limits = LimitsConfig {
            requests_per_minute: Some(2),
            input_tokens_per_minute: Some(100),
            ..LimitsConfig::default()
        };
        let limiter = local(vec![tenant("alpha", limits)]);
        limiter.admit("alpha", want(100, 0)).await.unwrap();
        for _ in 0..5 {
            let refused = limiter.admit("alpha", want(1, 0)).await.unwrap_err();
            assert!(refused.message.contains("input tokens"));
            // The requests' headers are still there: 1 of 2 left.
            assert_eq!(
                header(&refused.headers, "x-ratelimit-remaining-requests").as_deref(),
                Some("1")
            );
        }
        // Still one request left for one that fits the tokens, then none.
        limiter.admit("alpha", want(0, 0)).await.unwrap();
        let refused = limiter.admit("alpha", want(0, 0)).await.unwrap_err();
        assert!(refused.message.contains("requests"), "{}", refused.message);
    }

    #[tokio::test(start_paused = true)]
    async fn the_concurrency_slot_is_held_until_the_admission_is_dropped() {
        let limits = LimitsConfig {
            max_concurrent: Some(2),
            ..LimitsConfig::default()
        };
        let limiter = local(vec![
            tenant("alpha", limits),
            tenant("beta", LimitsConfig::default()),
        ]);
        let a = limiter.admit("alpha", Want::default()).await.unwrap();
        let b = limiter.admit("alpha", Want::default()).await.unwrap();
        let refused = limiter.admit("alpha", Want::default()).await.unwrap_err();
        assert_eq!((refused.status, refused.reason), (429, Reason::RateLimited));
        assert_eq!(refused.retry_after, Some(1));
        assert!(
            refused.message.contains("concurrent"),
            "{}",
            refused.message
        );
        limiter.admit("beta", Want::default()).await.unwrap();
        let status = limiter.snapshot();
        assert_eq!(status[0].tenant, "alpha");
        assert_eq!(status[0].in_flight, 2);
        drop(a);
        let c = limiter.admit("alpha", Want::default()).await.unwrap();
        assert!(limiter.admit("alpha", Want::default()).await.is_err());
        // Settling ends the slot too.
        b.settle(usage(1, 1, 0.0));
        limiter.admit("alpha", Want::default()).await.unwrap();
        drop(c);
    }

    fn budget(day: f64, mode: BudgetMode) -> BudgetConfig {
        BudgetConfig {
            usd_per_day: Some(day),
            usd_per_month: None,
            mode: Some(mode),
        }
    }

    fn overruns(tenant: &str, mode: &str) -> u64 {
        sluice_sdk::metrics::series(&metrics::BUDGET_OVERRUNS, &[tenant, mode])
            .map_or(0, |c| c.get())
    }

    #[tokio::test(start_paused = true)]
    async fn an_enforced_budget_refuses_once_spent() {
        let limiter = local(vec![
            (
                "spender".into(),
                LimitsConfig::default(),
                budget(1.0, BudgetMode::Enforce),
            ),
            tenant("other", LimitsConfig::default()),
        ]);
        let before = overruns("spender", "enforce");
        let a = limiter.admit("spender", Want::default()).await.unwrap();
        a.settle(usage(10, 10, 0.6));
        // $0.60 of $1: still in; this one crosses the budget, and is let through.
        let b = limiter.admit("spender", Want::default()).await.unwrap();
        b.settle(usage(10, 10, 0.5));
        let refused = limiter.admit("spender", Want::default()).await.unwrap_err();
        assert_eq!(
            (refused.status, refused.reason),
            (429, Reason::BudgetExceeded)
        );
        assert!(refused.retry_after.unwrap() >= 1);
        assert!(
            refused.message.contains("$1.10 spent of $1.00 per day"),
            "{}",
            refused.message
        );
        assert_eq!(overruns("spender", "enforce"), before + 1);
        limiter.admit("other", Want::default()).await.unwrap();
        let status = limiter.snapshot();
        let spender = status.iter().find(|u| u.tenant == "spender").unwrap();
        assert_eq!(spender.usd_spent_today, Some(1.1));
        assert_eq!(spender.usd_spent_this_month, Some(1.1));
    }

    #[tokio::test(start_paused = true)]
    async fn a_shadow_budget_counts_and_never_refuses() {
        let limiter = local(vec![(
            "watched".into(),
            LimitsConfig::default(),
            budget(1.0, BudgetMode::Shadow),
        )]);
        let before = overruns("watched", "shadow");
        limiter
            .admit("watched", Want::default())
            .await
            .unwrap()
            .settle(usage(1, 1, 2.5));
        for _ in 0..3 {
            limiter
                .admit("watched", Want::default())
                .await
                .unwrap()
                .settle(usage(1, 1, 1.0));
        }
        assert_eq!(overruns("watched", "shadow"), before + 3);
        let status = limiter.snapshot();
        assert_eq!(status[0].usd_spent_today, Some(5.5));
        assert_eq!(status[0].budget_mode, BudgetMode::Shadow);
        let json = serde_json::to_value(&status[0]).unwrap();
        assert_eq!(json["budget_mode"], "shadow");
        assert_eq!(json["store"], "local");
    }

    #[tokio::test(start_paused = true)]
    async fn the_snapshot_shows_what_remains() {
        let limits = LimitsConfig {
            requests_per_minute: Some(10),
            input_tokens_per_minute: Some(1000),
            ..LimitsConfig::default()
        };
        let limiter = local(vec![tenant("alpha", limits)]);
        let status = limiter.snapshot();
        assert_eq!(status[0].requests_remaining, Some(10));
        assert_eq!(status[0].input_tokens_remaining, Some(1000));
        assert_eq!(status[0].output_tokens_remaining, None);
        limiter.admit("alpha", want(250, 0)).await.unwrap();
        let status = limiter.snapshot();
        assert_eq!(status[0].requests_remaining, Some(9));
        assert_eq!(status[0].input_tokens_remaining, Some(750));
        tokio::time::advance(Duration::from_secs(60)).await;
        let status = limiter.snapshot();
        assert_eq!(status[0].requests_remaining, Some(10));
        assert_eq!(status[0].input_tokens_remaining, Some(1000));
    }
}

mod shared {
    use super::*;
    use sluice_testkit::{RedisCluster, RedisServer, SilentServer};
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::Instant;

    fn redis_store(redis: RedisConfig, on_redis_error: OnRedisError) -> StoreConfig {
        StoreConfig {
            kind: StoreKind::Redis,
            redis: Some(RedisConfig {
                // Generous for a loaded machine: these tests are about verdicts, not speed.
                timeout: Duration::from_millis(500),
                cooldown: Duration::from_millis(200),
                ..redis
            }),
            on_redis_error,
        }
    }

    fn single(url: String, on_redis_error: OnRedisError) -> StoreConfig {
        redis_store(
            RedisConfig {
                url: Some(url),
                ..RedisConfig::default()
            },
            on_redis_error,
        )
    }

    fn store_errors() -> u64 {
        ["timeout", "error", "cooldown"]
            .iter()
            .map(|kind| {
                sluice_sdk::metrics::series(&metrics::STORE_ERRORS, &["admit", kind])
                    .map_or(0, |c| c.get())
            })
            .sum()
    }

    /// A tenant that only makes admissions reach Redis.
    fn warm_tenant() -> (Arc<str>, LimitsConfig, BudgetConfig) {
        tenant("warm-up", rpm(1_000_000))
    }

    /// Waits until `limiter` is connected and its script loaded, so that the test's own
    /// admissions are not the ones spending a timeout on a handshake.
    async fn warm(limiter: &Limiter) {
        until(
            "Redis answers",
            || limiter.admit("warm-up", Want::default()),
            |r| r.as_ref().is_ok_and(|a| !a.headers().is_empty()),
        )
        .await;
    }

    /// Admits `n` requests of `tenant` at once, alternating between the replicas; the
    /// number admitted.
    async fn admit_together(replicas: &[Arc<Limiter>], tenant: &'static str, n: usize) -> usize {
        let tasks: Vec<_> = (0..n)
            .map(|i| {
                let limiter = Arc::clone(&replicas[i % replicas.len()]);
                tokio::spawn(async move { limiter.admit(tenant, Want::default()).await })
            })
            .collect();
        let mut admitted = 0;
        for task in tasks {
            match task.await.unwrap() {
                Ok(_) => admitted += 1,
                Err(e) => {
                    assert_eq!((e.status, e.reason), (429, Reason::RateLimited), "{e}");
                    assert_eq!(
                        header(&e.headers, "x-ratelimit-remaining-requests").as_deref(),
                        Some("0")
                    );
                }
            }
        }
        admitted
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_replicas_share_one_limit() {
        let redis = RedisServer::start();
        let replicas: Vec<Arc<Limiter>> = (0..2)
            .map(|_| {
                Arc::new(Limiter::start(
                    &single(redis.url(), OnRedisError::Deny),
                    vec![
                        tenant("alpha", rpm(5)),
                        tenant("beta", rpm(5)),
                        warm_tenant(),
                    ],
                ))
            })
            .collect();
        for r in &replicas {
            warm(r).await;
        }
        assert_eq!(admit_together(&replicas, "alpha", 20).await, 5);
        // Another tenant has its own keys.
        assert_eq!(admit_together(&replicas, "beta", 3).await, 3);
        let status = replicas[0].snapshot();
        let alpha = status.iter().find(|u| u.tenant == "alpha").unwrap();
        assert_eq!(alpha.store, "redis");
        assert!(alpha.requests_remaining.is_some());
    }

    /// Polls `admit` until `done` says so, within a bound meant never to be reached.
    async fn until<F, Fut>(
        what: &str,
        mut admit: F,
        done: impl Fn(&Result<Admitted, ErrorReply>) -> bool,
    ) where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<Admitted, ErrorReply>>,
    {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if done(&admit().await) {
                return;
            }
            assert!(Instant::now() < deadline, "never: {what}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn token_corrections_go_through_redis() {
        let redis = RedisServer::start();
        let limits = LimitsConfig {
            input_tokens_per_minute: Some(1000),
            ..LimitsConfig::default()
        };
        let start = || {
            Limiter::start(
                &single(redis.url(), OnRedisError::Deny),
                vec![tenant("alpha", limits.clone()), warm_tenant()],
            )
        };
        let (a, b) = (start(), start());
        warm(&a).await;
        warm(&b).await;
        let big = a.admit("alpha", want(800, 0)).await.unwrap();
        assert_eq!(
            header(&big.headers(), "x-ratelimit-remaining-tokens").as_deref(),
            Some("200")
        );
        let refused = b.admit("alpha", want(300, 0)).await.unwrap_err();
        assert!(
            refused.message.contains("input tokens"),
            "{}",
            refused.message
        );
        assert!(refused.retry_after.unwrap() >= 1);
        // Used 100 of 800: the refund, sent by one replica, lets the other's request in.
        big.settle(usage(100, 0, 0.0));
        until(
            "the refund reached Redis",
            || b.admit("alpha", want(300, 0)),
            Result::is_ok,
        )
        .await;
        // Used 5000 where 1 was estimated: minutes of debt, for both replicas.
        let small = a.admit("alpha", want(1, 0)).await.unwrap();
        small.settle(usage(5000, 0, 0.0));
        until(
            "the debt reached Redis",
            || b.admit("alpha", want(1, 0)),
            Result::is_err,
        )
        .await;
        let refused = a.admit("alpha", want(1, 0)).await.unwrap_err();
        assert!(refused.retry_after.unwrap() >= 60, "{refused:?}");
    }

    /// A replica (failing closed) limiting tenant `alpha` through `redis`, connected.
    async fn alpha_on(redis: &RedisServer, limits: LimitsConfig) -> Arc<Limiter> {
        let limiter = Arc::new(Limiter::start(
            &single(redis.url(), OnRedisError::Deny),
            vec![tenant("alpha", limits), warm_tenant()],
        ));
        warm(&limiter).await;
        limiter
    }

    /// How many EVALSHA calls `redis-server` has answered.
    fn script_calls(port: u16) -> u64 {
        let stats = sluice_testkit::redis_cli(port, &["INFO", "commandstats"]);
        stats
            .lines()
            .find_map(|l| l.strip_prefix("cmdstat_evalsha:calls="))
            .and_then(|rest| rest.split(',').next())
            .map_or(0, |n| n.parse().unwrap())
    }

    /// Admissions of one tenant that arrive while its call is in flight go together in the
    /// next call: fewer calls than admissions, and each admission still sees the charges of
    /// those before it, so the limit holds exactly and no two admitted share a count.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn admissions_arriving_together_share_calls_and_still_count_one_by_one() {
        const ASKED: usize = 300;
        let redis = RedisServer::start();
        let limiter = alpha_on(&redis, rpm(100)).await;
        let before = script_calls(redis.port());
        let tasks: Vec<_> = (0..ASKED)
            .map(|_| {
                let limiter = Arc::clone(&limiter);
                tokio::spawn(async move { limiter.admit("alpha", Want::default()).await })
            })
            .collect();
        let mut remaining = Vec::new();
        for task in tasks {
            match task.await.unwrap() {
                Ok(a) => remaining.push(
                    header(&a.headers(), "x-ratelimit-remaining-requests")
                        .unwrap()
                        .parse::<u64>()
                        .unwrap(),
                ),
                Err(e) => assert_eq!((e.status, e.reason), (429, Reason::RateLimited), "{e}"),
            }
        }
        let calls = script_calls(redis.port()) - before;
        remaining.sort_unstable();
        assert_eq!(
            remaining,
            (0..100).collect::<Vec<u64>>(),
            "100 admitted, each with its own count"
        );
        assert!(
            calls < ASKED as u64 / 2,
            "{calls} script calls for {ASKED} admissions"
        );
    }

    /// An admission given up while it waits for its batch (its client left) takes nothing
    /// down with it: the tenant's next admissions are answered.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_admission_dropped_while_queued_leaves_the_queue_working() {
        let redis = RedisServer::start();
        let limiter = alpha_on(&redis, rpm(1000)).await;
        for _ in 0..20 {
            let tasks: Vec<_> = (0..10)
                .map(|_| {
                    let limiter = Arc::clone(&limiter);
                    tokio::spawn(async move { limiter.admit("alpha", Want::default()).await })
                })
                .collect();
            // Half of them gone before their answer, whenever that is.
            for (i, task) in tasks.into_iter().enumerate() {
                if i % 2 == 0 {
                    task.abort();
                } else {
                    assert!(task.await.unwrap().is_ok());
                }
            }
        }
        assert!(limiter.admit("alpha", Want::default()).await.is_ok());
    }

    /// The admission sending its tenant's call is given up mid-call (its client left): the
    /// admissions queued behind it are still sent, by a task that takes over.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn admissions_queued_behind_a_sender_given_up_are_still_sent() {
        let redis = RedisServer::start();
        let limiter = alpha_on(&redis, rpm(1000)).await;
        // Redis holds every command for 300 ms: the first admission's call stays in flight.
        sluice_testkit::redis_cli(redis.port(), &["CLIENT", "PAUSE", "300", "ALL"]);
        let sender = {
            let limiter = Arc::clone(&limiter);
            tokio::spawn(async move { limiter.admit("alpha", Want::default()).await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        let queued = {
            let limiter = Arc::clone(&limiter);
            tokio::spawn(async move { limiter.admit("alpha", Want::default()).await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        sender.abort();
        // Answered once Redis resumes, well within the 500 ms the store waits.
        let admitted = queued.await.unwrap().unwrap();
        assert!(!admitted.headers().is_empty());
    }

    /// Admissions given up while they wait for their call (their client left) are dropped
    /// from the queue: Redis charges only those still waiting.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn admissions_given_up_while_queued_are_not_charged() {
        let redis = RedisServer::start();
        let limiter = alpha_on(&redis, rpm(1000)).await;
        // Redis holds every command for 300 ms: the first admission's call stays in flight
        // while the others queue behind it.
        sluice_testkit::redis_cli(redis.port(), &["CLIENT", "PAUSE", "300", "ALL"]);
        let admit = || {
            let limiter = Arc::clone(&limiter);
            tokio::spawn(async move { limiter.admit("alpha", Want::default()).await })
        };
        let first = admit();
        tokio::time::sleep(Duration::from_millis(50)).await;
        let gone: Vec<_> = (0..5).map(|_| admit()).collect();
        let kept = admit();
        tokio::time::sleep(Duration::from_millis(50)).await;
        for task in gone {
            task.abort();
        }
        let remaining = |a: Admitted| {
            header(&a.headers(), "x-ratelimit-remaining-requests")
                .unwrap()
                .parse::<u64>()
                .unwrap()
        };
        assert!(first.await.unwrap().is_ok());
        // `first` and `kept` were charged, not the five given up while queued: 2 of 1,000
        // (3 if a slow start let one of the five send its own call before the others).
        let charged = 1000 - remaining(kept.await.unwrap().unwrap());
        assert!((2..=3).contains(&charged), "{charged} charged");
    }

    /// The corrections of answers that end while one is on its way to Redis are summed into
    /// the next call: none is lost, and far fewer calls than answers reach Redis.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn corrections_ending_together_are_summed_into_few_calls() {
        const ANSWERS: u64 = 200;
        let redis = RedisServer::start();
        // 600 input tokens a minute: a token is 100 ms of the bucket, so the time the test
        // takes pays back only a few of the 200 tokens the corrections owe.
        let limits = LimitsConfig {
            input_tokens_per_minute: Some(600),
            ..LimitsConfig::default()
        };
        let limiter = Limiter::start(
            &single(redis.url(), OnRedisError::Deny),
            vec![tenant("alpha", limits), warm_tenant()],
        );
        warm(&limiter).await;
        let mut admitted = Vec::new();
        for _ in 0..ANSWERS {
            admitted.push(limiter.admit("alpha", want(0, 0)).await.unwrap());
        }

        let before = script_calls(redis.port());
        // Each answer used one input token more than it was charged.
        for a in admitted {
            a.settle(usage(1, 0, 0.0));
        }
        let polls = AtomicU64::new(0);
        let remaining = |r: &Result<Admitted, ErrorReply>| -> u64 {
            let a = r.as_ref().unwrap();
            header(&a.headers(), "x-ratelimit-remaining-tokens")
                .unwrap()
                .parse()
                .unwrap()
        };
        // 600 - 200 owed = 400, plus at most 2 s paid back while this waits.
        until(
            "all 200 corrections reached Redis",
            || {
                polls.fetch_add(1, Ordering::Relaxed);
                limiter.admit("alpha", want(0, 0))
            },
            |r| remaining(r) <= 420,
        )
        .await;
        let owed_now = 600 - remaining(&limiter.admit("alpha", want(0, 0)).await);
        assert!(owed_now >= 180, "owed {owed_now} of 200: corrections lost");
        let settles = script_calls(redis.port()) - before - polls.load(Ordering::Relaxed) - 1;
        assert!(
            (1..=ANSWERS / 2).contains(&settles),
            "{settles} settle calls for {ANSWERS} answers"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_budget_is_shared_through_redis() {
        let redis = RedisServer::start();
        let budget = BudgetConfig {
            usd_per_month: Some(1.0),
            ..BudgetConfig::default()
        };
        let start = || {
            Limiter::start(
                &single(redis.url(), OnRedisError::Deny),
                vec![
                    ("alpha".into(), LimitsConfig::default(), budget.clone()),
                    warm_tenant(),
                ],
            )
        };
        let (a, b) = (start(), start());
        warm(&a).await;
        warm(&b).await;
        a.admit("alpha", Want::default())
            .await
            .unwrap()
            .settle(usage(1, 1, 1.25));
        until(
            "the spend reached Redis",
            || b.admit("alpha", Want::default()),
            Result::is_err,
        )
        .await;
        let refused = b.admit("alpha", Want::default()).await.unwrap_err();
        assert_eq!(
            (refused.status, refused.reason),
            (429, Reason::BudgetExceeded)
        );
        assert!(refused.message.contains("per month"), "{}", refused.message);
        let status = b.snapshot();
        let alpha = status.iter().find(|u| u.tenant == "alpha").unwrap();
        assert_eq!(alpha.usd_spent_this_month, Some(1.25));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_killed_fails_open_or_closed_as_configured() {
        let mut redis = RedisServer::start();
        let tenants = || vec![tenant("alpha", rpm(2)), warm_tenant()];
        let open = Limiter::start(&single(redis.url(), OnRedisError::Allow), tenants());
        let closed = Limiter::start(&single(redis.url(), OnRedisError::Deny), tenants());
        warm(&open).await;
        warm(&closed).await;
        // Both reach Redis: the shared limit holds.
        open.admit("alpha", Want::default()).await.unwrap();
        closed.admit("alpha", Want::default()).await.unwrap();
        assert!(open.admit("alpha", Want::default()).await.is_err());
        assert!(closed.admit("alpha", Want::default()).await.is_err());

        redis.stop();
        let before = store_errors();
        for _ in 0..5 {
            let a = open.admit("alpha", Want::default()).await.unwrap();
            assert!(a.headers().is_empty());
            let e = closed.admit("alpha", Want::default()).await.unwrap_err();
            assert_eq!(
                (e.status, e.reason, e.retry_after),
                (503, Reason::RateLimited, Some(1))
            );
        }
        let after = store_errors();
        assert!(
            after >= before + 10,
            "every failed admission is counted: {before} -> {after}"
        );

        // Back (empty): the shared limit applies again once the cool-down lets a probe through.
        tokio::task::block_in_place(|| redis.restart());
        until(
            "Redis answers again",
            || closed.admit("alpha", Want::default()),
            Result::is_ok,
        )
        .await;
        closed.admit("alpha", Want::default()).await.unwrap();
        // The other replica reaches Redis again too (after its own cool-down), and is held
        // to the limit the first one spent.
        until(
            "the open replica reaches Redis again",
            || open.admit("alpha", Want::default()),
            Result::is_err,
        )
        .await;
        let e = open.admit("alpha", Want::default()).await.unwrap_err();
        assert_eq!((e.status, e.reason), (429, Reason::RateLimited));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_redis_that_hangs_costs_an_admission_its_timeout_only() {
        let silent = SilentServer::start().await;
        let mut store = single(silent.url(), OnRedisError::Allow);
        if let Some(r) = store.redis.as_mut() {
            r.timeout = Duration::from_millis(100);
        }
        let limiter = Limiter::start(&store, vec![tenant("alpha", rpm(1))]);
        let before = store_errors();
        for _ in 0..3 {
            let a = tokio::time::timeout(
                Duration::from_secs(10),
                limiter.admit("alpha", Want::default()),
            )
            .await
            .expect("an admission is bounded by the store's timeout");
            assert!(a.unwrap().headers().is_empty());
        }
        assert!(store_errors() >= before + 3);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_redis_cluster_keeps_each_tenant_on_one_slot() {
        let cluster = tokio::task::block_in_place(|| RedisCluster::start(3));
        let names: [&'static str; 6] = ["t0", "t1", "t2", "t3", "t4", "t5"];
        let config = redis_store(
            RedisConfig {
                cluster_nodes: cluster.urls(),
                ..RedisConfig::default()
            },
            OnRedisError::Deny,
        );
        let limits = LimitsConfig {
            requests_per_minute: Some(3),
            output_tokens_per_minute: Some(1_000_000),
            ..LimitsConfig::default()
        };
        let replicas: Vec<Arc<Limiter>> = (0..2)
            .map(|_| {
                Arc::new(Limiter::start(
                    &config,
                    names
                        .iter()
                        .map(|n| tenant(n, limits.clone()))
                        .chain([warm_tenant()])
                        .collect(),
                ))
            })
            .collect();
        for r in &replicas {
            warm(r).await;
        }
        for name in names {
            // Several keys per tenant in one script: a CROSSSLOT error would refuse all.
            assert_eq!(admit_together(&replicas, name, 8).await, 3, "{name}");
        }
        let sizes = tokio::task::block_in_place(|| cluster.dbsizes());
        assert!(
            sizes.iter().filter(|n| **n > 0).count() >= 2,
            "tenants spread over the nodes: {sizes:?}"
        );
    }
}
