//! The admin listener's dashboard (`GET /`), loaded in headless Chromium in front of
//! `sluice demo` with some traffic: it renders the fleet from `/status` and `/metrics`, and
//! needs nothing but the admin origin.
// Test code: a panic is a failed test, which is what it should be.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use serde_json::{json, Value};
use sluice_testkit::*;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

const CHROMIUM: &str = "/usr/bin/chromium";

/// Runs headless Chromium on `url` with `extra` flags (`--dump-dom`, `--screenshot=…`) and
/// a fresh profile; returns its stdout.
fn chromium(url: &str, extra: &[&str], profile: &Path) -> String {
    assert!(
        Path::new(CHROMIUM).exists(),
        "{CHROMIUM} is missing (Debian's `chromium`): run scripts/bootstrap --test"
    );
    let user_data = format!("--user-data-dir={}", profile.display());
    // `timeout` only guards against a hung browser; the virtual-time budget lets the page's
    // fetches and scripts run before the DOM or the screenshot is taken.
    let output = Command::new("timeout")
        .arg("120")
        .arg(CHROMIUM)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
            "--virtual-time-budget=5000",
            "--window-size=1400,1000",
            &user_data,
        ])
        .args(extra)
        .arg(url)
        .stdin(Stdio::null())
        .output()
        .expect("chromium runs");
    assert!(
        output.status.success(),
        "chromium failed ({}): {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// The page's percentage format (`toFixed(1)`).
fn pct(ratio: f64) -> String {
    format!("{:.1}%", ratio * 100.0)
}

fn target_dir() -> PathBuf {
    // …/target/<profile>/sluice → …/target
    Path::new(env!("CARGO_BIN_EXE_sluice"))
        .parent()
        .and_then(Path::parent)
        .expect("the binary is in the target directory")
        .to_path_buf()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_page_shows_the_fleet_in_a_browser_from_its_own_origin_only() {
    let (proxy, admin) = (reserve_port().release(), reserve_port().release());
    let demo = Demo::start(proxy, admin);
    let target_sim = demo.target.clone();
    let admin_url = format!("http://127.0.0.1:{admin}");
    // The admin and the proxy listener are two services that start apart: wait for both.
    let ready = wait_for(Duration::from_secs(60), || async {
        let admin_ready = client()
            .get(format!("{admin_url}/readyz"))
            .send()
            .await
            .is_ok_and(|r| r.status() == 200);
        admin_ready
            && client()
                .get(format!("http://127.0.0.1:{proxy}/v1/models"))
                .send()
                .await
                .is_ok_and(|r| r.status() == 200)
    })
    .await;
    assert!(ready.is_some(), "the demo did not get ready");

    // A known KV usage on the target pool's simulator, so the rendered number is stable.
    let kv = client()
        .post(format!("{target_sim}/sim/kv"))
        .json(&json!({"phantom_usage": 0.42}))
        .send()
        .await
        .expect("the target simulator answers");
    assert_eq!(kv.status(), 200);

    // Traffic: a miss then a hit, and a tenant over its limit (alpha: 5 a minute).
    let url = format!("http://127.0.0.1:{proxy}/v1/chat/completions");
    let hello = json!({"model": "meta-llama/Llama-3.2-1B-Instruct",
                       "messages": [{"role": "user", "content": "Hello!"}], "temperature": 0});
    assert_eq!(ask_url(&url, &hello, &[]).await.status, 200);
    let mut hit = false;
    for _ in 0..40 {
        if ask_url(&url, &hello, &[]).await.x_cache == "HIT" {
            hit = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(hit, "the second ask of the README's request hits the cache");
    let alpha = [("authorization", "Bearer sk-alpha-demo")];
    let mut statuses = Vec::new();
    for i in 0..6 {
        let body =
            json!({"model": "llama", "messages": [{"role": "user", "content": format!("q{i}")}]});
        statuses.push(ask_url(&url, &body, &alpha).await.status);
    }
    assert_eq!(statuses.last(), Some(&429), "alpha's sixth: {statuses:?}");

    let status = || async {
        client()
            .get(format!("{admin_url}/status"))
            .send()
            .await
            .expect("/status answers")
            .json::<Value>()
            .await
            .expect("/status is JSON")
    };
    let target_backend = |s: &Value| -> Value {
        s["pools"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == "target")
            .expect("the demo has a target pool")["backends"][0]
            .clone()
    };
    // The health checker scrapes the phantom usage on its own schedule.
    let scraped = wait_for(Duration::from_secs(30), || async {
        target_backend(&status().await)["kv_cache_usage"]
            .as_f64()
            .is_some_and(|u| u >= 0.42)
    })
    .await;
    assert!(
        scraped.is_some(),
        "the target's phantom KV usage reaches /status"
    );

    // The page itself: self-contained, with the headers that keep it so.
    let page = client()
        .get(format!("{admin_url}/"))
        .send()
        .await
        .expect("GET / answers");
    assert_eq!(page.status(), 200);
    let header = |name: &str| {
        page.headers()
            .get(name)
            .map(|v| v.to_str().unwrap().to_string())
            .unwrap_or_else(|| panic!("GET / has no {name} header"))
    };
    assert_eq!(header("content-type"), "text/html; charset=utf-8");
    let csp = header("content-security-policy");
    for directive in ["default-src 'none'", "connect-src 'self'"] {
        assert!(csp.contains(directive), "CSP {csp:?} lacks {directive:?}");
    }
    assert!(
        !csp.contains("http:") && !csp.contains("https:") && !csp.contains('*'),
        "CSP {csp:?} allows another origin"
    );
    assert_eq!(header("x-content-type-options"), "nosniff");
    assert_eq!(header("cache-control"), "no-cache");
    let html = page.text().await.unwrap();
    for outside in [
        "http://", "https://", "<link", " src=", " href=", "url(", "@import",
    ] {
        assert!(
            !html.contains(outside),
            "the page refers outside itself: {outside:?}"
        );
    }

    // Rendered in a real browser, once its two fetches came back.
    let profile = tempfile::tempdir().unwrap();
    let mut dom = String::new();
    for _ in 0..5 {
        dom = chromium(&format!("{admin_url}/"), &["--dump-dom"], profile.path());
        if dom.contains(r#"data-state="ok""#) {
            break;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    assert!(
        dom.contains(r#"data-state="ok""#),
        "the page never rendered /status and /metrics: {dom}"
    );
    let after = status().await;
    let shown = |class: &str, text: &str| dom.contains(&format!(r#"class="{class}">{text}<"#));

    for pool in after["pools"].as_array().unwrap() {
        let name = pool["name"].as_str().unwrap();
        assert!(shown("pool-name", name), "pool {name} is not shown");
        let source = format!("backends: {}", pool["source"].as_str().unwrap());
        assert!(
            shown("sub pool-source", &source),
            "{source} of {name} is not shown"
        );
        for backend in pool["backends"].as_array().unwrap() {
            let address = backend["address"].as_str().unwrap();
            assert!(
                shown("mono backend-address", address),
                "backend {address} of {name} is not shown"
            );
            let membership = backend["membership"].as_str().unwrap();
            let class = format!("pill membership {membership}");
            assert!(
                shown(&class, membership),
                "{address}'s membership is not shown"
            );
        }
    }
    let kv = target_backend(&after)["kv_cache_usage"].as_f64().unwrap();
    assert_eq!(pct(kv), "42.0%", "the phantom usage as /status has it");
    assert!(
        shown("kv-scraped", &pct(kv)),
        "the target's KV usage {} is not rendered",
        pct(kv)
    );
    for tenant in after["plugin_status"]["tenants"].as_array().unwrap() {
        let name = tenant["tenant"].as_str().unwrap();
        assert!(shown("tenant-name", name), "tenant {name} is not shown");
    }
    let chain: Vec<&str> = after["plugins"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap())
        .collect();
    assert!(chain.contains(&"kv_breaker") && chain.contains(&"cache"));
    let rendered_chain = chain
        .iter()
        .map(|p| format!(r#"<span class="plugin">{p}</span>"#))
        .collect::<Vec<_>>()
        .join("→");
    assert!(dom.contains(&rendered_chain), "the plugin chain {chain:?}");
    let metrics = client()
        .get(format!("{admin_url}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let ratio = metric_value(&metrics, "llm_cache_hit_ratio").expect("a cache hit ratio");
    assert!(ratio > 0.0, "one hit of two lookups");
    assert!(
        shown("big", &pct(ratio)),
        "the cache hit ratio {} is not rendered",
        pct(ratio)
    );
    assert!(
        dom.contains("<td>rate-limited</td>"),
        "alpha's 429 shows among the rejections"
    );
    assert!(
        !dom.contains("http://") && !dom.contains("https://"),
        "the rendered page links outside its origin"
    );

    // A screenshot, kept as a test artifact.
    let artifacts = target_dir().join("test-artifacts");
    std::fs::create_dir_all(&artifacts).unwrap();
    let png = artifacts.join("admin-dashboard.png");
    let _ = std::fs::remove_file(&png);
    chromium(
        &format!("{admin_url}/"),
        &[&format!("--screenshot={}", png.display())],
        profile.path(),
    );
    let bytes = std::fs::read(&png).expect("chromium wrote the screenshot");
    assert!(
        bytes.len() > 1000 && bytes.starts_with(b"\x89PNG\r\n\x1a\n"),
        "{} is not a PNG ({} bytes)",
        png.display(),
        bytes.len()
    );
}

/// Names come from the config and reach the page as text: a model and a tenant named like
/// markup show as those characters, and no element or script of theirs runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_from_the_config_are_shown_as_text_not_markup() {
    const MODEL: &str = r#"<img src=x onerror="document.title='pwned'">"#;
    const TENANT: &str = "<b id=injected>&amp;t</b>";
    let upstream = sim_serving(MODEL).await;
    let proxy = Proxy::start(json!({
        "pools": [pool("main", &[MODEL], &[upstream.addr()])],
        "plugins": {"tenants": {"enabled": true, "tenants": {
            TENANT: {"keys": [format!("sha256:{}", "ab".repeat(32))]},
        }}},
    }))
    .await;
    let status = proxy.status().await;
    assert_eq!(status["pools"][0]["models"][0], MODEL);

    let profile = tempfile::tempdir().unwrap();
    let mut dom = String::new();
    for _ in 0..5 {
        dom = chromium(&proxy.admin_url("/"), &["--dump-dom"], profile.path());
        if dom.contains(r#"data-state="ok""#) {
            break;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    assert!(dom.contains(r#"data-state="ok""#), "never rendered: {dom}");
    // The serializer escapes text as `&lt;`/`&amp;`; markup would come out as itself.
    assert!(
        dom.contains(r#"&lt;img src=x onerror="document.title='pwned'"&gt;"#),
        "the model name is not shown as text: {dom}"
    );
    assert!(
        dom.contains(r#"class="tenant-name">&lt;b id=injected&gt;&amp;amp;t&lt;/b&gt;<"#),
        "the tenant name is not shown as text: {dom}"
    );
    assert!(!dom.contains("<img"), "the model name became an element");
    assert!(
        !dom.contains("id=\"injected\""),
        "the tenant name became an element"
    );
    assert!(
        dom.contains("<title>Sluice</title>"),
        "a script from the data ran"
    );
}
