//! Running the `-- CMD ARGS…` of `elect campaign` and `lock` while the leadership or lock
//! lasts, and stopping it when it ends.

use std::os::unix::process::ExitStatusExt;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use tokio::process::{Child, Command};

use super::{CmdResult, Failure};

/// Default pause between SIGTERM and SIGKILL when CMD must stop.
pub const STOP_GRACE_DEFAULT: &str = "2s";

/// Starts CMD in its own process group (so stopping it reaches its children too) with `env`
/// added. On Linux CMD is also killed if this process dies: a leader's command must not outlive
/// the supervisor that would tell it leadership ended.
pub fn spawn(command: &[String], env: &[(&str, String)]) -> CmdResult<Child> {
    let (program, args) = command
        .split_first()
        .ok_or_else(|| Failure::invalid("no command after --"))?;
    let mut cmd = Command::new(program);
    cmd.args(args)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdin(Stdio::inherit())
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .process_group(0);
    #[cfg(target_os = "linux")]
    // SAFETY: prctl is async-signal-safe and touches only the calling (child) process.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd.spawn()
        .map_err(|e| Failure::invalid(format!("cannot start {program:?}: {e}")))
}

/// SIGTERM to CMD's process group, then SIGKILL if it has not exited after `grace`.
pub async fn stop(child: &mut Child, grace: Duration) -> Option<ExitStatus> {
    if let Some(pid) = child.id() {
        signal_group(pid, libc::SIGTERM);
        match tokio::time::timeout(grace, child.wait()).await {
            Ok(status) => return status.ok(),
            Err(_) => signal_group(pid, libc::SIGKILL),
        }
    }
    child.wait().await.ok()
}

fn signal_group(pid: u32, signal: i32) {
    if let Ok(pid) = i32::try_from(pid) {
        // SAFETY: kill(2) with a negative pid signals the process group CMD leads; no memory
        // is shared.
        unsafe {
            libc::kill(-pid, signal);
        }
    }
}

/// The shell's convention: the exit code, or 128 + the signal that ended it.
pub fn exit_code(status: ExitStatus) -> i32 {
    status
        .code()
        .or_else(|| status.signal().map(|s| 128 + s))
        .unwrap_or(1)
}
