//! Frees big things off the caller's thread, and removed files gently.
//!
//! The storage's caller is the Raft thread, and two of its chores cost far more than their
//! results are worth to it:
//! - freeing the blocks of a removed segment or snapshot file: the kernel takes about a quarter
//!   of a millisecond per MiB here (a 133 MB snapshot: 37 ms), all of it inside the system
//!   call that drops the file's last reference;
//! - freeing a replaced snapshot image held in memory (tens to hundreds of MB).
//!
//! [`release`] and [`release_removed_file`] hand such a thing to one background thread.
//! Nothing waits for it: a removed file's name is gone at once (see `OsDisk::remove_file`),
//! and a dropped image has no reader left. If the thread cannot be started, or has stopped,
//! the caller frees the thing itself, which is only slower.
//!
//! A removed file is shrunk [`FREE_STEP_BYTES`] at a time before it is closed. On a file
//! system mounted with online discard, freeing blocks sends the device a discard that the log's
//! next cache flush waits behind: freeing three 150 MB files at once held the log's
//! `fdatasync`s for up to 20 ms on this machine, and freeing them in 8 MiB steps 2 ms apart
//! left them within their usual 6 ms (`docs/performance.md`).

use std::fs::File;
use std::sync::OnceLock;
use std::sync::mpsc::{Sender, channel};
use std::time::Duration;

/// How much of a removed file is freed at a time.
pub const FREE_STEP_BYTES: u64 = 8 << 20;
/// The pause between two steps of freeing a removed file.
pub const FREE_STEP_PAUSE_MS: u64 = 2;

enum Released {
    Value(Box<dyn Send>),
    RemovedFile(File),
}

/// Drops `thing` on the release thread, or here if there is none.
pub fn release<T: Send + 'static>(thing: T) {
    send(Released::Value(Box::new(thing)));
}

/// Frees the blocks of `file`, whose name was removed while it was open, then closes it; on
/// the release thread, or here if there is none.
pub fn release_removed_file(file: File) {
    send(Released::RemovedFile(file));
}

fn send(released: Released) {
    match release_queue() {
        // A send fails only when the thread has gone; the thing then comes back to us.
        Some(queue) => {
            if let Err(returned) = queue.send(released) {
                free(returned.0);
            }
        }
        None => free(released),
    }
}

fn free(released: Released) {
    match released {
        Released::Value(value) => drop(value),
        Released::RemovedFile(file) => free_gradually(file),
    }
}

/// Shrinks an unlinked file step by step; closing it frees whatever is left.
fn free_gradually(file: File) {
    let Ok(mut len_bytes) = file.metadata().map(|meta| meta.len()) else {
        return;
    };
    while len_bytes > 0 {
        len_bytes = len_bytes.saturating_sub(FREE_STEP_BYTES);
        if file.set_len(len_bytes).is_err() {
            return;
        }
        if len_bytes > 0 {
            std::thread::sleep(Duration::from_millis(FREE_STEP_PAUSE_MS));
        }
    }
}

fn release_queue() -> Option<&'static Sender<Released>> {
    static QUEUE: OnceLock<Option<Sender<Released>>> = OnceLock::new();
    QUEUE
        .get_or_init(|| {
            let (queue, released) = channel::<Released>();
            std::thread::Builder::new()
                .name("conclave-release".into())
                .spawn(move || {
                    for thing in released {
                        free(thing);
                    }
                })
                .ok()
                .map(|_| queue)
        })
        .as_ref()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    #[test]
    fn a_released_thing_is_dropped_on_another_thread() {
        struct Noted(Arc<std::sync::Mutex<Option<std::thread::ThreadId>>>);
        impl Drop for Noted {
            fn drop(&mut self) {
                *self.0.lock().unwrap() = Some(std::thread::current().id());
            }
        }
        let dropped_on = Arc::new(std::sync::Mutex::new(None));
        release(Noted(dropped_on.clone()));
        let deadline = Instant::now() + Duration::from_secs(10);
        let thread = loop {
            if let Some(thread) = *dropped_on.lock().unwrap() {
                break thread;
            }
            assert!(
                Instant::now() < deadline,
                "the released value was never dropped"
            );
            std::thread::sleep(Duration::from_millis(1));
        };
        assert_ne!(thread, std::thread::current().id());
    }

    /// The open descriptors of this process that point at `path`, removed or not.
    fn descriptors_of(path: &std::path::Path) -> usize {
        let deleted = format!("{} (deleted)", path.display());
        std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(|item| std::fs::read_link(item.ok()?.path()).ok())
            .filter(|target| target == path || target.to_string_lossy() == deleted)
            .count()
    }

    #[test]
    fn a_removed_file_loses_its_name_at_once_and_is_closed_later() {
        use crate::disk::{Disk, OsDisk};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("segment");
        // Three steps, so the file is shrunk and paused on before it is closed.
        std::fs::write(&path, vec![7u8; (2 * FREE_STEP_BYTES + 1) as usize]).unwrap();
        OsDisk.remove_file(&path).unwrap();
        assert!(
            !path.exists(),
            "the name must be gone when remove_file returns"
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        while descriptors_of(&path) > 0 {
            assert!(
                Instant::now() < deadline,
                "the removed file was never closed"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}
