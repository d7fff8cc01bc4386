//! The directory of the PID file and of Pingora's upgrade socket must be this user's alone.
//!
//! At a binary upgrade the old process connects to whatever listens at `upgrade_sock` and
//! hands it its listening sockets; Pingora's new process unlinks the path and binds it. In a
//! directory other users can write to (the sticky `/tmp` of a shared host), another user who
//! creates the path first keeps it (the sticky bit stops the unlink) and receives the
//! listeners; a PID file there can be a symlink to a file of theirs. So both must live in a
//! directory only this user (or root) can change: created with mode 0700 when missing,
//! refused otherwise, as tmux and ssh-agent treat their sockets' directories.

use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::Path;

/// Makes sure the directory of `file` (a config value, named by `key` in errors) exists and
/// is private: owned by this user or root, writable by no one else; its ancestors may be
/// writable by others only when sticky (no one else can rename what is in them).
pub fn make_private(file: &str, key: &str) -> Result<(), String> {
    let dir = match Path::new(file).parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    let refuse = |why: String| Err(format!("{key}: {file}: {why}"));
    if !dir.exists() {
        if let Err(e) = std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
        {
            return refuse(format!("cannot create {}: {e}", dir.display()));
        }
    }
    let me = nix::unistd::geteuid().as_raw();
    let mut at = Some(dir);
    let mut own_dir = true;
    while let Some(path) = at {
        let meta = match std::fs::metadata(path) {
            Ok(meta) => meta,
            Err(e) => return refuse(format!("cannot read {}: {e}", path.display())),
        };
        if meta.uid() != me && meta.uid() != 0 {
            return refuse(format!(
                "{} belongs to another user (uid {}); use a directory of your own, e.g. /run/sluice",
                path.display(),
                meta.uid()
            ));
        }
        let others_write = meta.mode() & 0o022 != 0;
        let sticky = meta.mode() & 0o1000 != 0;
        if others_write && (own_dir || !sticky) {
            return refuse(format!(
                "other users can write to {}, and one of them could take the listening sockets \
                 at the next upgrade; use a directory of your own, e.g. /run/sluice",
                path.display()
            ));
        }
        own_dir = false;
        at = path.parent().filter(|p| !p.as_os_str().is_empty());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_missing_directory_is_created_private_and_a_shared_one_refused() {
        let root = tempfile::tempdir().unwrap();
        let sock = root.path().join("run/sluice/upgrade.sock");
        make_private(sock.to_str().unwrap(), "pingora.upgrade_sock").unwrap();
        let made = std::fs::metadata(root.path().join("run/sluice")).unwrap();
        assert_eq!(made.mode() & 0o777, 0o700);

        let shared = root.path().join("shared");
        std::fs::create_dir(&shared).unwrap();
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
        let in_shared = shared.join("upgrade.sock");
        let refused = make_private(in_shared.to_str().unwrap(), "pingora.upgrade_sock");
        assert!(
            refused
                .as_ref()
                .is_err_and(|e| e.contains("other users can write")),
            "{refused:?}"
        );
        // Below a sticky shared directory, a private one of our own is fine.
        let below = shared.join("mine/upgrade.sock");
        make_private(below.to_str().unwrap(), "pingora.upgrade_sock").unwrap();

        let open = root.path().join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let below_open = open.join("mine/sluice.pid");
        assert!(make_private(below_open.to_str().unwrap(), "pingora.pid_file").is_err());
    }
}
