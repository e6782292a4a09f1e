//! Where the members live. Preferably each `conclave serve` runs in its own network namespace,
//! all joined by a bridge that itself sits in a switch namespace, and the harness moves itself
//! into a client namespace on the same bridge: no address of the run exists in the host's
//! namespace, so two runs never collide and nothing leaves the machine. Partitions are
//! iptables rules inside the members' namespaces.
//!
//! Where namespaces cannot be made, members run on loopback ports and the only partition
//! available is cutting a member's inbound peer traffic with per-port rules in a chain of the
//! run's own; the run says so.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::process::Command;

use crate::Error;

/// Subnet of a run's private bridge (inside namespaces the run created; never routed from
/// the host's namespace).
const SUBNET: &str = "10.99.0";
/// Address of the harness on the bridge.
const CLIENT_HOST: u8 = 100;
/// Client and peer ports of a member in its own namespace.
pub const NS_CLIENT_PORT: u16 = 2379;
pub const NS_PEER_PORT: u16 = 2380;
/// Prefix of every namespace a run creates: `cf<pid>` then a role.
const NAME_PREFIX: &str = "cf";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Namespaces,
    Loopback,
}

/// A member's addresses and, with namespaces, its namespace.
#[derive(Debug, Clone)]
pub struct Place {
    pub namespace: Option<String>,
    pub host: String,
    pub client_addr: String,
    pub peer_addr: String,
    pub peer_port: u16,
}

pub struct Net {
    pub mode: Mode,
    pub places: Vec<Place>,
    namespaces: Vec<String>,
    loopback_chain: Option<String>,
}

/// Runs a command; an error carries its stderr.
pub fn sh(program: &str, args: &[&str]) -> Result<(), Error> {
    let out = Command::new(program)
        .args(args)
        .output()
        .map_err(|source| Error::Io {
            what: format!("run {program}"),
            source,
        })?;
    if out.status.success() {
        Ok(())
    } else {
        Err(Error::Command {
            command: format!("{program} {}", args.join(" ")),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        })
    }
}

fn sh_out(program: &str, args: &[&str]) -> String {
    Command::new(program)
        .args(args)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).to_string())
        .unwrap_or_default()
}

/// Removes what runs that no longer exist left behind (their processes, namespaces).
pub fn clean_stale() {
    for line in sh_out("ip", &["netns", "list"]).lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        let Some(rest) = name.strip_prefix(NAME_PREFIX) else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if std::path::Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        for pid in sh_out("ip", &["netns", "pids", name]).split_whitespace() {
            if let Ok(pid) = pid.parse::<i32>() {
                // SAFETY: kill(2) with a pid read from the kernel's list for that namespace.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
        let _ = sh("ip", &["netns", "del", name]);
        eprintln!("removed namespace {name} left by an earlier run (pid {pid})");
    }
}

impl Net {
    /// Sets up `members` places, in namespaces when allowed. `force_loopback` skips trying.
    pub fn new(members: usize, force_loopback: bool, first_port: u16) -> Result<Net, Error> {
        if !force_loopback {
            match Net::namespaces(members) {
                Ok(net) => return Ok(net),
                Err(error) => eprintln!(
                    "network namespaces are not available ({error}); falling back to loopback: \
                     partitions are limited to cutting a member's inbound peer traffic"
                ),
            }
        }
        Net::loopback(members, first_port)
    }

    fn namespaces(members: usize) -> Result<Net, Error> {
        let run = format!("{NAME_PREFIX}{}", std::process::id());
        let mut net = Net {
            mode: Mode::Namespaces,
            places: Vec::new(),
            namespaces: Vec::new(),
            loopback_chain: None,
        };
        let switch = format!("{run}-sw");
        net.add_namespace(&switch)?;
        sh(
            "ip",
            &["-n", &switch, "link", "add", "br0", "type", "bridge"],
        )?;
        sh("ip", &["-n", &switch, "link", "set", "br0", "up"])?;
        let attach = |ns: &str, host: u8, net: &mut Net| -> Result<(), Error> {
            net.add_namespace(ns)?;
            sh("ip", &["-n", ns, "link", "set", "lo", "up"])?;
            let port = format!("p{host}");
            sh(
                "ip",
                &[
                    "-n", &switch, "link", "add", &port, "type", "veth", "peer", "name", "eth0",
                    "netns", ns,
                ],
            )?;
            sh(
                "ip",
                &["-n", &switch, "link", "set", &port, "master", "br0"],
            )?;
            sh("ip", &["-n", &switch, "link", "set", &port, "up"])?;
            let address = format!("{SUBNET}.{host}/24");
            sh("ip", &["-n", ns, "addr", "add", &address, "dev", "eth0"])?;
            sh("ip", &["-n", ns, "link", "set", "eth0", "up"])?;
            Ok(())
        };
        for i in 1..=members {
            let ns = format!("{run}-n{i}");
            let host = u8::try_from(i).map_err(|_| Error::Usage("too many members".into()))?;
            attach(&ns, host, &mut net)?;
            let ip = format!("{SUBNET}.{i}");
            net.places.push(Place {
                namespace: Some(ns),
                client_addr: format!("{ip}:{NS_CLIENT_PORT}"),
                peer_addr: format!("{ip}:{NS_PEER_PORT}"),
                peer_port: NS_PEER_PORT,
                host: ip,
            });
        }
        let client_ns = format!("{run}-c");
        attach(&client_ns, CLIENT_HOST, &mut net)?;
        // The harness joins the client namespace; every thread started later inherits it.
        let file =
            File::open(format!("/var/run/netns/{client_ns}")).map_err(|source| Error::Io {
                what: format!("open namespace {client_ns}"),
                source,
            })?;
        // SAFETY: setns(2) on a namespace file we just opened; called before any other thread
        // of this process exists (the async runtime starts afterwards).
        let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
        if rc != 0 {
            return Err(Error::Io {
                what: format!("join namespace {client_ns}"),
                source: std::io::Error::last_os_error(),
            });
        }
        sh("ip", &["link", "set", "lo", "up"])?;
        Ok(net)
    }

    fn add_namespace(&mut self, name: &str) -> Result<(), Error> {
        sh("ip", &["netns", "add", name])?;
        self.namespaces.push(name.to_string());
        Ok(())
    }

    fn loopback(members: usize, first_port: u16) -> Result<Net, Error> {
        let mut places = Vec::new();
        for i in 0..members {
            let base = first_port + 2 * u16::try_from(i).unwrap_or(0);
            places.push(Place {
                namespace: None,
                host: "127.0.0.1".into(),
                client_addr: format!("127.0.0.1:{base}"),
                peer_addr: format!("127.0.0.1:{}", base + 1),
                peer_port: base + 1,
            });
        }
        let chain = format!("CF{}", std::process::id());
        let loopback_chain = match sh("iptables", &["-N", &chain])
            .and_then(|()| sh("iptables", &["-I", "INPUT", "-j", &chain]))
        {
            Ok(()) => Some(chain),
            Err(error) => {
                eprintln!("iptables is not usable ({error}); partitions are off on loopback");
                None
            }
        };
        Ok(Net {
            mode: Mode::Loopback,
            places,
            namespaces: Vec::new(),
            loopback_chain,
        })
    }

    /// Whether a partition of this shape can be made here.
    pub fn can_partition(&self) -> bool {
        self.mode == Mode::Namespaces || self.loopback_chain.is_some()
    }

    /// Drops every packet member `to` (0-based) receives from member `from`.
    pub fn drop_link(&self, from: usize, to: usize) -> Result<(), Error> {
        match self.mode {
            Mode::Namespaces => {
                let ns = self.places[to].namespace.as_deref().unwrap_or_default();
                let src = &self.places[from].host;
                sh(
                    "ip",
                    &[
                        "netns", "exec", ns, "iptables", "-A", "INPUT", "-s", src, "-j", "DROP",
                    ],
                )
            }
            Mode::Loopback => {
                // Sources are not told apart on loopback: cut all inbound peer traffic of `to`.
                let chain = self.loopback_chain.as_deref().unwrap_or_default();
                let port = self.places[to].peer_port.to_string();
                sh(
                    "iptables",
                    &["-A", chain, "-p", "tcp", "--dport", &port, "-j", "DROP"],
                )
            }
        }
    }

    /// Removes every partition rule.
    pub fn heal(&self) -> Result<(), Error> {
        match self.mode {
            Mode::Namespaces => {
                for place in &self.places {
                    let ns = place.namespace.as_deref().unwrap_or_default();
                    sh("ip", &["netns", "exec", ns, "iptables", "-F", "INPUT"])?;
                }
                Ok(())
            }
            Mode::Loopback => match &self.loopback_chain {
                Some(chain) => sh("iptables", &["-F", chain]),
                None => Ok(()),
            },
        }
    }

    /// The command line that runs `program` in member `index`'s place.
    pub fn command(&self, index: usize, program: &std::path::Path) -> Command {
        match &self.places[index].namespace {
            Some(ns) => {
                let mut command = Command::new("ip");
                command.args(["netns", "exec", ns]).arg(program);
                command
            }
            None => Command::new(program),
        }
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for ns in self.namespaces.iter().rev() {
            for pid in sh_out("ip", &["netns", "pids", ns]).split_whitespace() {
                // The harness itself lives in the client namespace.
                if let Ok(pid) = pid.parse::<i32>()
                    && pid != std::process::id() as i32
                {
                    // SAFETY: kill(2) on a process inside a namespace this run created.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
            }
            if let Err(error) = sh("ip", &["netns", "del", ns]) {
                eprintln!("clean-up: {error}");
            }
        }
        if let Some(chain) = &self.loopback_chain {
            let _ = sh("iptables", &["-D", "INPUT", "-j", chain]);
            let _ = sh("iptables", &["-F", chain]);
            let _ = sh("iptables", &["-X", chain]);
        }
    }
}
