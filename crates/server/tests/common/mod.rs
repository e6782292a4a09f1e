//! What the server's in-process tests share.

use std::net::TcpListener;
use std::sync::atomic::{AtomicU32, Ordering};

/// Test ports come from below Linux's ephemeral range (32768 and up), so a node restarted on
/// its port never finds it taken by some connection's source port.
const TEST_PORT_FIRST: u32 = 20_000;
const TEST_PORT_SPAN: u32 = 12_000;
static NEXT_PORT: AtomicU32 = AtomicU32::new(0);

/// A port nothing listens on right now, handed out once per test process; concurrent test
/// processes start apart by their pid.
pub fn free_port() -> u16 {
    let start = std::process::id().wrapping_mul(151) % TEST_PORT_SPAN;
    loop {
        let offset = (start + NEXT_PORT.fetch_add(1, Ordering::SeqCst)) % TEST_PORT_SPAN;
        let port = (TEST_PORT_FIRST + offset) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}
