//! deploy/Containerfile: its runtime stage, built as written with buildah, gives an image with
//! no shell, a numeric non-root user, the binary, its config, and the entry point and ports
//! that config needs. In the image's root filesystem (chroot, as the image's user) the binary
//! accepts its config and names the key of a broken one; started there on a read-only root
//! with a tmpfs /tmp, it serves, reaching a TLS backend through the CA bundle at distroless's
//! path, and stops cleanly on SIGTERM. The binary links only libraries the distroless base
//! ships. And buildah reads the whole file up to its first base image.
//!
//! The base images (`rust:…-bookworm`, `gcr.io/distroless/cc-debian12`) cannot be pulled here
//! and no container may run, so the runtime stage is built on stand-ins, in a private buildah
//! storage (vfs, in a temporary folder, removed at the end): the distroless base by an image
//! holding what it ships and the binary needs (the libraries `ldd` names, the loader, CA
//! certificates, passwd and group entries, /tmp), the build stage by a build context holding
//! this test's `sluice`, stripped as the build stage strips it. Needs root (chroot, and a
//! mount namespace that keeps buildah's cache off the machine).
// Test code: a panic is a failed test, which is what it should be.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use sluice_testkit::{tls_front, TestCa};
use std::collections::BTreeSet;
use std::ffi::OsStr;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

const BOOTSTRAP: &str = "run scripts/bootstrap --test";

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The shared libraries of gcr.io/distroless/cc-debian12 (its `cc` flavour: Debian 12's libc6,
/// libgcc-s1, libgomp1, libstdc++6, and libssl3 from `base`), by soname, with the loaders.
/// (libmvec, glibc's vector math, is libc6's too: usearch's C++ links it.)
const DISTROLESS_CC_LIBS: &[&str] = &[
    "libc.so.6",
    "libm.so.6",
    "libmvec.so.1",
    "libdl.so.2",
    "libpthread.so.0",
    "librt.so.1",
    "libresolv.so.2",
    "libutil.so.1",
    "libgcc_s.so.1",
    "libgomp.so.1",
    "libstdc++.so.6",
    "libssl.so.3",
    "libcrypto.so.3",
    "ld-linux-x86-64.so.2",
    "ld-linux-aarch64.so.1",
];

/// Programs that would make the image a shell away from anything.
const SHELLS: &[&str] = &[
    "sh", "bash", "dash", "ash", "zsh", "ksh", "mksh", "csh", "tcsh", "fish", "busybox",
];

// ---- reading deploy/Containerfile ----

/// One instruction: its keyword (upper case), its arguments (continuations joined) and the
/// index of its first line in the file.
#[derive(Debug, Clone)]
struct Instruction {
    keyword: String,
    args: String,
    line: usize,
}

fn containerfile() -> String {
    std::fs::read_to_string(root().join("deploy/Containerfile")).unwrap()
}

fn instructions(text: &str) -> Vec<Instruction> {
    let mut out = Vec::new();
    let mut current: Option<(usize, String)> = None;
    for (i, line) in text.lines().enumerate() {
        let trimmed = line.trim();
        // Comments and blank lines are dropped, within a continuation too (as Docker does).
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        let (start, mut joined) = current.take().unwrap_or((i, String::new()));
        let (part, continues) = match trimmed.strip_suffix('\\') {
            Some(part) => (part, true),
            None => (trimmed, false),
        };
        joined.push_str(part);
        joined.push(' ');
        if continues {
            current = Some((start, joined));
        } else {
            let joined = joined.trim().to_string();
            let (keyword, args) = joined
                .split_once(char::is_whitespace)
                .unwrap_or((&joined, ""));
            out.push(Instruction {
                keyword: keyword.to_ascii_uppercase(),
                args: args.trim().to_string(),
                line: start,
            });
        }
    }
    assert!(
        current.is_none(),
        "deploy/Containerfile ends in a continuation"
    );
    out
}

/// The stages: each starts with its FROM.
fn stages(all: &[Instruction]) -> Vec<Vec<Instruction>> {
    let mut out: Vec<Vec<Instruction>> = Vec::new();
    for i in all {
        if i.keyword == "FROM" {
            out.push(Vec::new());
        }
        if let Some(stage) = out.last_mut() {
            stage.push(i.clone());
        }
    }
    assert!(
        out.len() >= 2,
        "deploy/Containerfile: a build stage and a runtime stage expected"
    );
    out
}

/// `FROM [--flags] image [AS name]` → (image, name).
fn from_line(from: &Instruction) -> (String, Option<String>) {
    let words: Vec<&str> = from
        .args
        .split_whitespace()
        .filter(|w| !w.starts_with("--"))
        .collect();
    let name = match words.as_slice() {
        [_, as_, name] if as_.eq_ignore_ascii_case("as") => Some(name.to_string()),
        [_] => None,
        _ => panic!("unexpected FROM: {}", from.args),
    };
    (words[0].to_string(), name)
}

/// `COPY [--from=x] [--flags] src... dst` → (from, sources, destination).
fn copy_line(copy: &Instruction) -> (Option<String>, Vec<String>, String) {
    let mut from = None;
    let mut paths = Vec::new();
    for word in copy.args.split_whitespace() {
        if let Some(stage) = word.strip_prefix("--from=") {
            from = Some(stage.to_string());
        } else if !word.starts_with("--") {
            paths.push(word.to_string());
        }
    }
    assert!(
        paths.len() >= 2 && !copy.args.starts_with('['),
        "COPY with one source and a destination, shell form expected: {}",
        copy.args
    );
    let dest = paths.pop().unwrap();
    (from, paths, dest)
}

/// The one instruction `keyword` of a stage.
fn only<'a>(stage: &'a [Instruction], keyword: &str) -> &'a Instruction {
    let found: Vec<&Instruction> = stage.iter().filter(|i| i.keyword == keyword).collect();
    assert_eq!(
        found.len(),
        1,
        "one {keyword} expected in the runtime stage"
    );
    found[0]
}

fn json_list(i: &Instruction) -> Vec<String> {
    serde_json::from_str(&i.args)
        .unwrap_or_else(|e| panic!("{} must be in JSON (exec) form: {e}", i.keyword))
}

/// What the runtime stage says.
struct Runtime {
    /// Its text, from its FROM to the end of the file, as written.
    text: String,
    base: String,
    /// The build stage it copies from, and the paths it takes from there.
    build_stage: String,
    from_build: Vec<(String, String)>,
    /// COPY sources from the build context → their destinations.
    from_context: Vec<(String, String)>,
    user: String,
    exposed: BTreeSet<String>,
    entrypoint: Vec<String>,
    cmd: Vec<String>,
}

fn runtime() -> Runtime {
    let text = containerfile();
    let all = instructions(&text);
    let stages = stages(&all);
    let (_, build_name) = from_line(&stages[0][0]);
    let build_name = build_name.expect("the build stage is named (FROM … AS build)");
    let stage = stages.last().unwrap();
    let (base, _) = from_line(&stage[0]);
    let mut from_build = Vec::new();
    let mut from_context = Vec::new();
    for i in stage {
        match i.keyword.as_str() {
            "RUN" => panic!("the runtime stage has no shell to RUN with: {}", i.args),
            "ADD" => panic!("the runtime stage copies with COPY: ADD {}", i.args),
            "COPY" => {
                let (from, sources, dest) = copy_line(i);
                for source in sources {
                    match &from {
                        Some(f) if *f == build_name => from_build.push((source, dest.clone())),
                        Some(f) => panic!("COPY --from={f}: only the build stage `{build_name}`"),
                        None => from_context.push((source, dest.clone())),
                    }
                }
            }
            _ => {}
        }
    }
    let lines: Vec<&str> = text.lines().collect();
    Runtime {
        text: lines[stage[0].line..].join("\n") + "\n",
        base,
        build_stage: build_name,
        from_build,
        from_context,
        user: only(stage, "USER").args.clone(),
        exposed: only(stage, "EXPOSE")
            .args
            .split_whitespace()
            .map(|p| {
                if p.contains('/') {
                    p.to_string()
                } else {
                    format!("{p}/tcp")
                }
            })
            .collect(),
        entrypoint: json_list(only(stage, "ENTRYPOINT")),
        cmd: json_list(only(stage, "CMD")),
    }
}

// ---- tools ----

/// Runs `program`; a missing one fails the test with how to get it.
fn run(program: &str, args: &[&OsStr], envs: &[(&str, &Path)]) -> Output {
    let mut command = Command::new(program);
    command.args(args).current_dir(root());
    for (k, v) in envs {
        command.env(k, v);
    }
    match command.output() {
        Ok(out) => out,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            panic!("{program} is missing: {BOOTSTRAP}")
        }
        Err(e) => panic!("{program} could not be run: {e}"),
    }
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// buildah on a private vfs storage in a temporary folder: nothing of the machine's own
/// storage is read or written, and all of it is removed on drop.
struct Buildah {
    dir: tempfile::TempDir,
}

impl Buildah {
    fn new() -> Self {
        let version = run("buildah", &[OsStr::new("--version")], &[]);
        assert!(version.status.success(), "buildah: {}", text(&version));
        let dir = tempfile::tempdir().unwrap();
        let conf = dir.path().join("storage.conf");
        std::fs::write(
            &conf,
            format!(
                "[storage]\ndriver = \"vfs\"\nrunroot = \"{0}/runroot\"\ngraphroot = \"{0}/root\"\n",
                dir.path().display()
            ),
        )
        .unwrap();
        Buildah { dir }
    }

    fn run(&self, args: &[&OsStr]) -> Output {
        let root = self.dir.path().join("root");
        let runroot = self.dir.path().join("runroot");
        let mut all: Vec<&OsStr> = vec![
            OsStr::new("--storage-driver"),
            OsStr::new("vfs"),
            OsStr::new("--root"),
            root.as_os_str(),
            OsStr::new("--runroot"),
            runroot.as_os_str(),
        ];
        all.extend_from_slice(args);
        // Its own storage.conf, so that the machine's cannot add image stores or options.
        let conf = self.dir.path().join("storage.conf");
        // As root, buildah also writes a cache of layer digests to /var/lib/containers/cache
        // whatever --root says: in a mount namespace of its own, on a tmpfs that goes with it.
        let mut wrapped: Vec<&OsStr> = vec![
            OsStr::new("--mount"),
            OsStr::new("--propagation"),
            OsStr::new("private"),
            OsStr::new("sh"),
            OsStr::new("-c"),
            OsStr::new("mount -t tmpfs sluice-image-test /var/lib && exec buildah \"$@\""),
            OsStr::new("sh"),
        ];
        wrapped.extend(all);
        // Its temporary files (layers being committed) in the same folder, not /var/tmp.
        let tmp = self.dir.path().join("tmp");
        std::fs::create_dir_all(&tmp).unwrap();
        run(
            "unshare",
            &wrapped,
            &[("CONTAINERS_STORAGE_CONF", &conf), ("TMPDIR", &tmp)],
        )
    }

    /// Runs buildah; its standard output, trimmed, when it succeeds.
    fn ok(&self, args: &[&OsStr]) -> String {
        let out = self.run(args);
        assert!(
            out.status.success(),
            "buildah {args:?} failed:\n{}",
            text(&out)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }
}

impl Drop for Buildah {
    fn drop(&mut self) {
        // vfs mounts nothing, but buildah keeps track: let it forget before the folder goes.
        let _ = self.run(&[OsStr::new("umount"), OsStr::new("--all")]);
        let _ = self.run(&[OsStr::new("rm"), OsStr::new("--all")]);
    }
}

fn os<S: AsRef<OsStr> + ?Sized>(s: &S) -> &OsStr {
    s.as_ref()
}

/// The files `ldd` says `binary` loads: (soname, path), the loader included, the vDSO not.
fn shared_libraries(binary: &Path) -> Vec<(String, PathBuf)> {
    let out = run("ldd", &[binary.as_os_str()], &[]);
    assert!(
        out.status.success(),
        "ldd {}: {}",
        binary.display(),
        text(&out)
    );
    let mut libs = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let line = line.trim();
        assert!(!line.contains("not found"), "ldd: {line}");
        let (name, rest) = line.split_once(' ').unwrap_or((line, ""));
        let path = match rest.strip_prefix("=> ") {
            Some(rest) => rest.split(" (").next().unwrap().to_string(),
            None if name.starts_with('/') => name.to_string(),
            None => continue, // linux-vdso.so.1: in the kernel, not a file
        };
        let soname = Path::new(name)
            .file_name()
            .unwrap()
            .to_string_lossy()
            .to_string();
        libs.push((soname, PathBuf::from(path)));
    }
    assert!(
        !libs.is_empty(),
        "ldd names no library: is sluice linked statically now?"
    );
    libs
}

fn copy_file(from: &Path, to: &Path) {
    std::fs::create_dir_all(to.parent().unwrap()).unwrap();
    // std::fs::copy follows symlinks: the library itself, under the name the binary asks for.
    std::fs::copy(from, to)
        .unwrap_or_else(|e| panic!("{} → {}: {e}", from.display(), to.display()));
}

/// Builds the runtime stage as written on its stand-ins; the image's name.
fn build_runtime(buildah: &Buildah, rt: &Runtime) -> String {
    let binary = Path::new(env!("CARGO_BIN_EXE_sluice"));
    let work = buildah.dir.path();

    // The distroless base, as far as Sluice uses it. It sets no USER (distroless :nonroot
    // does), so the image's user is the one the runtime stage sets.
    let base = work.join("base");
    for (_, path) in shared_libraries(binary) {
        copy_file(&path, &base.join(path.strip_prefix("/").unwrap()));
    }
    copy_file(
        Path::new("/etc/ssl/certs/ca-certificates.crt"),
        &base.join("etc/ssl/certs/ca-certificates.crt"),
    );
    let (uid, gid) = numeric_user(&rt.user);
    std::fs::write(
        base.join("etc/passwd"),
        format!(
            "root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:{uid}:{gid}:nonroot:/home/nonroot:/sbin/nologin\n"
        ),
    )
    .unwrap();
    std::fs::write(
        base.join("etc/group"),
        format!("root:x:0:\nnonroot:x:{gid}:\n"),
    )
    .unwrap();
    std::fs::create_dir_all(base.join("tmp")).unwrap();
    std::fs::set_permissions(base.join("tmp"), std::fs::Permissions::from_mode(0o1777)).unwrap();
    let container = buildah.ok(&[os("from"), os("scratch")]);
    buildah.ok(&[os("copy"), os(&container), base.as_os_str(), os("/")]);
    buildah.ok(&[os("commit"), os("--quiet"), os(&container), os(&rt.base)]);
    buildah.ok(&[os("rm"), os(&container)]);

    // The build stage: what the runtime stage takes from it, at the same paths.
    let build = work.join("build");
    for (source, _) in &rt.from_build {
        assert!(
            source.ends_with("/sluice"),
            "COPY --from={} {source}: the test knows only the binary",
            rt.build_stage
        );
        let to = build.join(source.trim_start_matches('/'));
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        // As the build stage does: the debug sections go, the symbols stay.
        let out = run(
            "strip",
            &[
                os("--strip-debug"),
                os("-o"),
                to.as_os_str(),
                binary.as_os_str(),
            ],
            &[],
        );
        assert!(out.status.success(), "strip (binutils): {}", text(&out));
    }

    // The runtime stage, as written; the build context is the workspace root, as documented
    // (with its .dockerignore).
    let file = work.join("runtime.Containerfile");
    std::fs::write(&file, &rt.text).unwrap();
    let image = "localhost/sluice-image-test";
    let build_context = format!("{}={}", rt.build_stage, build.display());
    buildah.ok(&[
        os("bud"),
        os("--quiet"),
        os("--pull=never"),
        os("--build-context"),
        os(&build_context),
        os("-f"),
        file.as_os_str(),
        os("-t"),
        os(image),
        root().as_os_str(),
    ]);
    image.to_string()
}

/// `USER uid:gid`, both numeric and not root.
fn numeric_user(user: &str) -> (u32, u32) {
    let (uid, gid) = user
        .split_once(':')
        .unwrap_or_else(|| panic!("USER {user}: uid:gid expected"));
    let uid: u32 = uid
        .parse()
        .unwrap_or_else(|_| panic!("USER {user}: numeric uid expected"));
    let gid: u32 = gid
        .parse()
        .unwrap_or_else(|_| panic!("USER {user}: numeric gid expected"));
    assert!(uid != 0 && gid != 0, "USER {user}: not root");
    (uid, gid)
}

/// Every path under `dir` (symlinks not followed).
fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let meta = std::fs::symlink_metadata(&path).unwrap();
        out.push(path.clone());
        if meta.is_dir() {
            walk(&path, out);
        }
    }
}

/// The ports the container's config listens on, as `port/tcp`.
fn config_ports(config: &str) -> BTreeSet<String> {
    let yaml: serde_yaml_ng::Value = serde_yaml_ng::from_str(config).unwrap();
    let mut addresses: Vec<&str> = yaml["listeners"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|l| l["address"].as_str().unwrap())
        .collect();
    addresses.push(yaml["admin"]["address"].as_str().unwrap());
    addresses
        .iter()
        .map(|a| {
            let (host, port) = a.rsplit_once(':').unwrap();
            // Published ports reach the container's interface, not its loopback.
            assert!(
                host == "0.0.0.0" || host == "[::]",
                "{a}: a container must listen on every interface"
            );
            format!("{port}/tcp")
        })
        .collect()
}

fn chroot_sluice(rootfs: &Path, user: &str, args: &[&str]) -> Output {
    let mut all: Vec<&OsStr> = vec![os("--userspec"), os(user), rootfs.as_os_str()];
    all.extend(args.iter().map(os));
    run("chroot", &all, &[])
}

#[test]
fn the_runtime_stage_builds_a_shell_free_non_root_image_that_checks_its_config() {
    assert!(
        run("id", &[os("-u")], &[]).stdout.starts_with(b"0\n"),
        "this test builds with buildah and chroots into the image: run it as root"
    );
    let rt = runtime();
    assert!(
        rt.base.starts_with("gcr.io/distroless/cc-debian12"),
        "the runtime base is {}: the test's stand-in and DISTROLESS_CC_LIBS are for cc-debian12",
        rt.base
    );
    let config_source = "deploy/container/sluice.yaml";
    let config = std::fs::read_to_string(root().join(config_source)).unwrap();

    // The runtime stage agrees with itself and with the config it ships.
    let (_, binary_dest) = rt.from_build.first().expect("the binary, from build");
    assert_eq!(
        rt.entrypoint.first(),
        Some(binary_dest),
        "ENTRYPOINT runs the copied binary"
    );
    let config_dest = rt
        .from_context
        .iter()
        .find(|(source, _)| source == config_source)
        .map(|(_, dest)| dest.clone())
        .expect("the runtime stage copies deploy/container/sluice.yaml");
    let args: Vec<&String> = rt.entrypoint[1..].iter().chain(&rt.cmd).collect();
    assert!(
        args.windows(2)
            .any(|w| w[0] == "-c" && *w[1] == config_dest),
        "ENTRYPOINT/CMD must run `-c {config_dest}`: {args:?}"
    );
    assert_eq!(
        rt.exposed,
        config_ports(&config),
        "EXPOSE: the ports of {config_source}"
    );

    let buildah = Buildah::new();
    let image = build_runtime(&buildah, &rt);

    // The image's config: what a runtime (Docker, Kubernetes) reads.
    let inspect: serde_json::Value =
        serde_json::from_str(&buildah.ok(&[os("inspect"), os("--type"), os("image"), os(&image)]))
            .unwrap();
    let oci = &inspect["OCIv1"]["config"];
    let user = oci["User"].as_str().unwrap_or_default().to_string();
    numeric_user(&user);
    assert_eq!(user, rt.user);
    assert_eq!(oci["Entrypoint"], serde_json::json!(rt.entrypoint));
    assert_eq!(oci["Cmd"], serde_json::json!(rt.cmd));
    let exposed: BTreeSet<String> = oci["ExposedPorts"]
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .collect();
    assert_eq!(exposed, rt.exposed);

    // Its root filesystem, as a container made from it sees it.
    let container = buildah.ok(&[os("from"), os("--pull=never"), os(&image)]);
    let rootfs = PathBuf::from(buildah.ok(&[os("mount"), os(&container)]));
    let mut paths = Vec::new();
    walk(&rootfs, &mut paths);
    for path in &paths {
        let name = path.file_name().unwrap().to_string_lossy();
        assert!(
            !SHELLS.contains(&name.as_ref()),
            "a shell in the image: {}",
            path.strip_prefix(&rootfs).unwrap().display()
        );
    }
    assert!(
        std::fs::symlink_metadata(rootfs.join("bin/sh")).is_err(),
        "/bin/sh in the image"
    );

    let in_image = |p: &str| rootfs.join(p.trim_start_matches('/'));
    let bin = std::fs::metadata(in_image(binary_dest)).unwrap();
    assert!(
        bin.is_file() && bin.mode() & 0o111 == 0o111,
        "{binary_dest}: executable by all"
    );
    // The process cannot replace its own binary or config: root's, not writable by others.
    for p in [binary_dest.as_str(), config_dest.as_str()] {
        let meta = std::fs::metadata(in_image(p)).unwrap();
        assert_eq!(
            (meta.uid(), meta.mode() & 0o022),
            (0, 0),
            "{p}: root's, read-only to others"
        );
    }
    assert!(
        std::fs::read_to_string(in_image(&config_dest)).unwrap() == config,
        "{config_dest} in the image is not {config_source} (copied before conf/?)"
    );
    assert!(
        in_image("/etc/sluice/examples/multi-pool.yaml").is_file(),
        "conf/ is under /etc/sluice/"
    );

    // The entry point, as the image's user, accepts the shipped config...
    let mut command: Vec<&str> = rt.entrypoint.iter().map(String::as_str).collect();
    command.extend(rt.cmd.iter().map(String::as_str));
    command.push("-t");
    let out = chroot_sluice(&rootfs, &user, &command);
    assert!(
        out.status.success(),
        "sluice -t in the image:\n{}",
        text(&out)
    );
    assert!(text(&out).contains("is valid"), "{}", text(&out));

    // ... and refuses a broken one, naming the key.
    let broken = config.replacen("first_byte: 30s", "first_byte: 30", 1);
    assert_ne!(broken, config);
    std::fs::write(in_image("/tmp/broken.yaml"), broken).unwrap();
    let out = chroot_sluice(
        &rootfs,
        &user,
        &[&rt.entrypoint[0], "-c", "/tmp/broken.yaml", "-t"],
    );
    assert!(!out.status.success(), "a broken config passed in the image");
    assert!(
        text(&out).contains("pools[0].timeouts.first_byte"),
        "the error names the key:\n{}",
        text(&out)
    );
}

#[test]
fn the_binary_links_only_what_the_runtime_base_ships() {
    for (soname, path) in shared_libraries(Path::new(env!("CARGO_BIN_EXE_sluice"))) {
        assert!(
            DISTROLESS_CC_LIBS.contains(&soname.as_str()),
            "sluice now links {soname} ({}), which gcr.io/distroless/cc-debian12 lacks",
            path.display()
        );
    }
}

#[test]
fn the_build_stage_makes_what_the_runtime_stage_copies() {
    let all = instructions(&containerfile());
    let stages = stages(&all);
    let build = &stages[0];
    let (image, _) = from_line(&build[0]);
    // The binary links the build image's glibc: it must be Debian 12's, as the runtime's.
    assert!(
        image.ends_with("-bookworm"),
        "the build stage runs on {image}, not bookworm"
    );
    let runs: Vec<&str> = build
        .iter()
        .filter(|i| i.keyword == "RUN")
        .map(|i| i.args.as_str())
        .collect();
    let cargo = runs
        .iter()
        .find(|r| r.contains("cargo build"))
        .expect("the build stage runs cargo build");
    for flag in ["--release", "--locked", "--bin sluice"] {
        assert!(cargo.contains(flag), "cargo build without {flag}: {cargo}");
    }
    for (source, _) in runtime().from_build {
        assert!(
            cargo.contains(&format!(" {source}")),
            "the runtime stage copies {source}, which the build stage's cargo RUN never makes"
        );
    }
}

#[test]
fn buildah_expands_the_args_and_orders_the_stages() {
    // buildah has no dry run. With --pull=never it reads the file, expands the ARGs, orders
    // the stages and stops at the first base image it would have to pull; buildah 1.28
    // checks little else before that (an unknown instruction or a FROM without an image gets
    // as far), so this shows only the base image the build starts from, the number of
    // stages, and that the build stage comes first (a runtime stage copying from an unknown
    // stage would be built first). The runtime stage is built in full above.
    let all = instructions(&containerfile());
    let stages = stages(&all);
    let (image, _) = from_line(&stages[0][0]);
    let mut expanded = image.clone();
    for arg in all.iter().take_while(|i| i.keyword == "ARG") {
        if let Some((name, default)) = arg.args.split_once('=') {
            expanded = expanded.replace(&format!("${{{name}}}"), default);
        }
    }
    assert!(!expanded.contains('$'), "{image}: an ARG without a default");
    let buildah = Buildah::new();
    let out = buildah.run(&[
        os("bud"),
        os("--pull=never"),
        os("-f"),
        root().join("deploy/Containerfile").as_os_str(),
        root().as_os_str(),
    ]);
    let log = text(&out);
    assert!(
        !out.status.success(),
        "built without its base images?\n{log}"
    );
    let first_step = format!(
        "[1/{}] STEP 1/{}: FROM {expanded}",
        stages.len(),
        stages[0].len()
    );
    assert!(log.contains(&first_step), "expected `{first_step}`:\n{log}");
    assert!(
        log.contains(&format!("{expanded}: image not known")),
        "buildah stopped before the first base image:\n{log}"
    );
}

/// Kills the process on drop, so that a failed assertion leaves nothing running.
struct Running(std::process::Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_image_serves_as_its_user_on_a_read_only_root_and_trusts_its_ca_bundle() {
    assert!(
        run("id", &[os("-u")], &[]).stdout.starts_with(b"0\n"),
        "this test builds with buildah and chroots into the image: run it as root"
    );
    let rt = runtime();
    let buildah = Buildah::new();
    let image = build_runtime(&buildah, &rt);
    let container = buildah.ok(&[os("from"), os("--pull=never"), os(&image)]);
    let rootfs = PathBuf::from(buildah.ok(&[os("mount"), os(&container)]));
    let in_image = |p: &str| rootfs.join(p.trim_start_matches('/'));

    // A vLLM behind TLS whose certificate only a CA of the test signs. The CA goes into the
    // image's bundle, where distroless keeps Debian's (no `pingora.ca_file`): an answer
    // proves that Sluice reads the system's CAs from there.
    const SNI: &str = "vllm.image.test";
    let ca = TestCa::new("Sluice image test CA");
    let sim = vllm_sim::start(
        vllm_sim::SimConfig::default().with_model("meta-llama/Llama-3.2-1B-Instruct"),
    )
    .await
    .unwrap();
    let front = tls_front(ca.server_config(SNI), sim.addr()).await;
    let bundle = in_image("/etc/ssl/certs/ca-certificates.crt");
    let mut cas = std::fs::read_to_string(&bundle).unwrap();
    cas.push_str(&ca.pem);
    std::fs::write(&bundle, cas).unwrap();

    // The container's config as shipped, on free ports, its draft pool on that vLLM.
    let config_source = "deploy/container/sluice.yaml";
    let mut config: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(root().join(config_source)).unwrap())
            .unwrap();
    let (proxy_port, admin_port) = (sluice_testkit::free_port(), sluice_testkit::free_port());
    config["listeners"][0]["address"] = format!("0.0.0.0:{proxy_port}").into();
    config["admin"]["address"] = format!("0.0.0.0:{admin_port}").into();
    let draft = &mut config["pools"][0];
    draft["backends"][0]["address"] = front.to_string().into();
    draft["tls"] = serde_yaml_ng::from_str(&format!("{{sni: {SNI}}}")).unwrap();
    // The target pool on the same vLLM, in plain HTTP: no port the machine may be using.
    config["pools"][1]["backends"][0]["address"] = sim.addr().to_string().into();
    // Where a Kubernetes ConfigMap or `docker run -v` puts it: beside the shipped one.
    std::fs::write(
        in_image("/etc/sluice/run.yaml"),
        serde_yaml_ng::to_string(&config).unwrap(),
    )
    .unwrap();

    // As a runtime would start it: the image's user, no environment but the image's, and as
    // deploy/kubernetes runs it, a read-only root with a tmpfs on /tmp. Each step execs the
    // next (unshare without --fork, sh, chroot), so the child's pid is Sluice's.
    let user = rt.user.clone();
    let env: Vec<String> = serde_json::from_value(
        serde_json::from_str::<serde_json::Value>(&buildah.ok(&[
            os("inspect"),
            os("--type"),
            os("image"),
            os(&image),
        ]))
        .unwrap()["OCIv1"]["config"]["Env"]
            .clone(),
    )
    .unwrap();
    let log = buildah.dir.path().join("sluice.log");
    let mut command = Command::new("unshare");
    command.env_clear();
    for pair in &env {
        let (k, v) = pair.split_once('=').unwrap();
        command.env(k, v);
    }
    command
        .args(["--mount", "--propagation", "private", "/bin/sh", "-c"])
        .arg(
            "mount --bind \"$1\" \"$1\" && mount -o remount,bind,ro \"$1\" \
             && mount -t tmpfs -o mode=1777 sluice-tmp \"$1/tmp\" \
             && exec /usr/sbin/chroot --userspec \"$2\" \"$1\" \"$3\" -c /etc/sluice/run.yaml",
        )
        .arg("sh")
        .arg(&rootfs)
        .arg(&user)
        .arg(&rt.entrypoint[0])
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap());
    let mut sluice = Running(command.spawn().unwrap());

    let client = sluice_testkit::client();
    // Ready when the TLS backend has passed its health check (over TLS, so through the
    // bundle too): before that, a request might find no healthy backend.
    let ready = sluice_testkit::wait_for(Duration::from_secs(30), || {
        let url = format!("http://127.0.0.1:{admin_port}/status");
        let client = client.clone();
        let front = front.to_string();
        async move {
            let Ok(r) = client.get(url).send().await else {
                return false;
            };
            let status: serde_json::Value = r.json().await.unwrap_or_default();
            status["pools"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|p| p["name"] == "draft")
                .flat_map(|p| p["backends"].as_array().cloned().unwrap_or_default())
                .any(|b| b["address"] == front.as_str() && b["health"] == "healthy")
        }
    })
    .await;
    let logs = || std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        ready.is_some(),
        "sluice in the image never became ready:\n{}",
        logs()
    );
    let answer = sluice_testkit::ask_url(
        &format!("http://127.0.0.1:{proxy_port}/v1/chat/completions"),
        &sluice_testkit::chat("meta-llama/Llama-3.2-1B-Instruct", "Hello!", false),
        &[],
    )
    .await;
    assert_eq!(answer.status, 200, "{}\n{}", answer.body, logs());
    assert_eq!(answer.headers["x-sluice-pool"], "draft");

    // It runs as the image's user, not root.
    let status = std::fs::read_to_string(format!("/proc/{}/status", sluice.0.id())).unwrap();
    let uid = numeric_user(&user).0;
    assert!(
        status.lines().any(
            |l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some(&*uid.to_string())
        ),
        "not running as {uid}:\n{status}"
    );

    // ... on a read-only root, writing only to /tmp.
    let mounts = std::fs::read_to_string(format!("/proc/{}/mountinfo", sluice.0.id())).unwrap();
    let options = |point: &str| {
        mounts
            .lines()
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .find(|f| f.get(4) == Some(&point))
            .map(|f| f[5].to_string())
            .unwrap_or_else(|| panic!("no mount on {point} in Sluice's view:\n{mounts}"))
    };
    assert!(
        options("/").split(',').any(|o| o == "ro"),
        "/ is writable:\n{mounts}"
    );
    assert!(options("/tmp").split(',').any(|o| o == "rw"));

    // SIGTERM, as `docker stop` sends it: a clean exit.
    sluice_testkit::signal(sluice.0.id(), "TERM");
    sluice_testkit::exits_within(&mut sluice.0, Duration::from_secs(40)).await;
}
