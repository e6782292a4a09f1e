//! The floor of a replicated put on this machine: the least work any 3-member service that
//! answers etcd's `KV.Put` over gRPC must do before it answers, and nothing else.
//!
//! A leader process serves `KV.Put` with tonic (the gRPC stack Conclave uses). Each put's
//! request is encoded into a log record and handed to one writer thread, which gathers the
//! records waiting, sends them as one frame to two follower processes over TCP, appends them
//! to its own file and `fdatasync`s it, and answers once its own sync and the first follower's
//! acknowledgement are in. A follower appends each frame to its file, `fdatasync`s it and
//! acknowledges. There is no consensus, no state machine, no recovery, and the log files are
//! pre-written with zeros so that a sync flushes data only.
//!
//! `scripts/bench-cpu-per-put` runs `etcd-bench` against it beside etcd and Conclave: if the
//! floor itself cannot do twice etcd's puts at one client, no server on this machine can.
//!
//!   put-floor follower --listen 127.0.0.1:19702 --dir /tmp/f1
//!   put-floor leader --listen 127.0.0.1:19701 --followers 127.0.0.1:19702,127.0.0.1:19703 --dir /tmp/l

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use conclave_proto::etcdserverpb::kv_server::{Kv, KvServer};
use conclave_proto::etcdserverpb::{
    CompactionRequest, CompactionResponse, DeleteRangeRequest, DeleteRangeResponse, PutRequest,
    PutResponse, RangeRequest, RangeResponse, ResponseHeader, TxnRequest, TxnResponse,
};
use prost::Message;
use tokio::sync::oneshot;
use tonic::{Request, Response, Status};

/// Default size of each log file in MiB, written with zeros before the first put; writes wrap
/// around in it.
const LOG_FILE_MIB_DEFAULT: u64 = 64;
/// The largest log file `--log-mib` allows.
const LOG_FILE_MIB_MAX: u64 = 4096;
/// Largest frame a follower accepts (a frame carries one batch of encoded put requests).
const FRAME_BYTES_MAX: usize = 64 << 20;
/// How long the leader keeps trying to reach a follower that is still starting.
const CONNECT_WAIT: Duration = Duration::from_secs(10);

#[derive(Parser)]
#[command(
    about = "The floor of a replicated put: gRPC in, two followers and three fsyncs, gRPC out"
)]
struct Args {
    /// Size of this process's log file in MiB (1 to 4096), written with zeros at the start.
    #[arg(long, global = true, default_value_t = LOG_FILE_MIB_DEFAULT)]
    log_mib: u64,
    #[command(subcommand)]
    role: Role,
}

#[derive(Subcommand)]
enum Role {
    /// Appends and syncs each frame the leader sends, and acknowledges it.
    Follower {
        #[arg(long)]
        listen: SocketAddr,
        #[arg(long)]
        dir: PathBuf,
    },
    /// Serves KV.Put; answers once its own sync and one follower's acknowledgement are in.
    Leader {
        #[arg(long)]
        listen: SocketAddr,
        /// Two follower addresses, comma-separated.
        #[arg(long, value_delimiter = ',', required = true)]
        followers: Vec<SocketAddr>,
        #[arg(long)]
        dir: PathBuf,
        /// Replicate on the gRPC worker itself, one put at a time, instead of handing each
        /// put to a writer thread: no hand-off between threads, and no batching either.
        #[arg(long)]
        inline: bool,
    },
}

#[derive(Debug, thiserror::Error)]
enum FloorError {
    #[error("log file {path}: {source}")]
    Log { path: PathBuf, source: io::Error },
    #[error("peer {addr}: {source}")]
    Peer { addr: SocketAddr, source: io::Error },
    #[error("frame of {0} bytes is above the {FRAME_BYTES_MAX}-byte limit")]
    FrameTooLarge(usize),
    #[error("gRPC server: {0}")]
    Serve(#[from] tonic::transport::Error),
    #[error("{0}")]
    Usage(String),
    #[error("runtime: {0}")]
    Runtime(io::Error),
}

/// A pre-written file appended to at a wrapping offset.
struct Log {
    file: File,
    offset: u64,
    size_bytes: u64,
}

impl Log {
    fn create(dir: &Path, size_mib: u64) -> Result<Log, FloorError> {
        let path = dir.join("log");
        let failed = |source| FloorError::Log {
            path: path.clone(),
            source,
        };
        std::fs::create_dir_all(dir).map_err(failed)?;
        let mut file = OpenOptions::new()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .open(&path)
            .map_err(failed)?;
        let zeros = vec![0u8; 1 << 20];
        for _ in 0..size_mib {
            file.write_all(&zeros).map_err(failed)?;
        }
        file.sync_all().map_err(failed)?;
        Ok(Log {
            file,
            offset: 0,
            size_bytes: size_mib << 20,
        })
    }

    fn append_and_sync(&mut self, bytes: &[u8]) -> io::Result<()> {
        if self.offset + bytes.len() as u64 > self.size_bytes {
            self.offset = 0;
        }
        self.file.write_all_at(bytes, self.offset)?;
        self.offset += bytes.len() as u64;
        self.file.sync_data()
    }
}

fn follower(listen: SocketAddr, dir: &Path, log_mib: u64) -> Result<(), FloorError> {
    let mut log = Log::create(dir, log_mib)?;
    let peer = |source| FloorError::Peer {
        addr: listen,
        source,
    };
    let listener = TcpListener::bind(listen).map_err(peer)?;
    loop {
        let (mut stream, from) = listener.accept().map_err(peer)?;
        stream.set_nodelay(true).map_err(peer)?;
        let mut frame = Vec::new();
        // One leader at a time; a closed connection waits for the next leader.
        let served = (|| -> Result<(), FloorError> {
            loop {
                let mut head = [0u8; 12];
                stream
                    .read_exact(&mut head)
                    .map_err(|source| FloorError::Peer { addr: from, source })?;
                let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
                if len > FRAME_BYTES_MAX {
                    return Err(FloorError::FrameTooLarge(len));
                }
                frame.resize(len, 0);
                stream
                    .read_exact(&mut frame)
                    .map_err(|source| FloorError::Peer { addr: from, source })?;
                log.append_and_sync(&frame)
                    .map_err(|source| FloorError::Log {
                        path: dir.join("log"),
                        source,
                    })?;
                stream
                    .write_all(&head[4..12])
                    .map_err(|source| FloorError::Peer { addr: from, source })?;
            }
        })();
        if let Err(error) = served {
            eprintln!("put-floor follower: {error}; waiting for the next connection");
        }
    }
}

/// One put waiting to be made durable and answered.
struct Pending {
    record: Vec<u8>,
    done: oneshot::Sender<u64>,
}

struct FollowerLink {
    addr: SocketAddr,
    stream: TcpStream,
    acked: u64,
}

fn connect(addr: SocketAddr) -> Result<FollowerLink, FloorError> {
    let started = Instant::now();
    loop {
        match TcpStream::connect(addr) {
            Ok(stream) => {
                stream
                    .set_nodelay(true)
                    .map_err(|source| FloorError::Peer { addr, source })?;
                return Ok(FollowerLink {
                    addr,
                    stream,
                    acked: 0,
                });
            }
            Err(source) if started.elapsed() > CONNECT_WAIT => {
                return Err(FloorError::Peer { addr, source });
            }
            Err(_) => thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// Waits until at least one follower has acknowledged `seq`, reading whatever
/// acknowledgements are ready on either link.
fn await_first_ack(links: &mut [FollowerLink], seq: u64) -> Result<(), FloorError> {
    while links.iter().all(|link| link.acked < seq) {
        let mut fds: Vec<libc::pollfd> = links
            .iter()
            .map(|link| libc::pollfd {
                fd: link.stream.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        // SAFETY: `fds` is a live, correctly sized array of pollfd for the call's duration.
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
        if ready < 0 {
            let source = io::Error::last_os_error();
            if source.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(FloorError::Peer {
                addr: links[0].addr,
                source,
            });
        }
        for (link, fd) in links.iter_mut().zip(&fds) {
            if fd.revents != 0 {
                let mut ack = [0u8; 8];
                link.stream
                    .read_exact(&mut ack)
                    .map_err(|source| FloorError::Peer {
                        addr: link.addr,
                        source,
                    })?;
                link.acked = u64::from_le_bytes(ack);
            }
        }
    }
    Ok(())
}

/// The leader's side of replication: its log, its two follower links and the last frame sent.
struct Replicator {
    log: Log,
    log_path: PathBuf,
    links: Vec<FollowerLink>,
    seq: u64,
    frame: Vec<u8>,
}

impl Replicator {
    fn start(followers: &[SocketAddr], dir: &Path, log_mib: u64) -> Result<Replicator, FloorError> {
        Ok(Replicator {
            log: Log::create(dir, log_mib)?,
            log_path: dir.join("log"),
            links: followers
                .iter()
                .map(|&addr| connect(addr))
                .collect::<Result<Vec<_>, _>>()?,
            seq: 0,
            frame: Vec::new(),
        })
    }

    /// Sends `records` to both followers as one frame, appends and syncs them locally, and
    /// returns the frame's sequence number once one follower has acknowledged it too.
    fn replicate<'a>(
        &mut self,
        records: impl Iterator<Item = &'a [u8]>,
    ) -> Result<u64, FloorError> {
        self.seq += 1;
        let frame = &mut self.frame;
        frame.clear();
        frame.extend_from_slice(&[0; 4]);
        frame.extend_from_slice(&self.seq.to_le_bytes());
        for record in records {
            frame.extend_from_slice(&(record.len() as u32).to_le_bytes());
            frame.extend_from_slice(record);
        }
        let body_len = (frame.len() - 12) as u32;
        frame[..4].copy_from_slice(&body_len.to_le_bytes());
        for link in &mut self.links {
            link.stream
                .write_all(frame)
                .map_err(|source| FloorError::Peer {
                    addr: link.addr,
                    source,
                })?;
        }
        self.log
            .append_and_sync(&frame[12..])
            .map_err(|source| FloorError::Log {
                path: self.log_path.clone(),
                source,
            })?;
        await_first_ack(&mut self.links, self.seq)?;
        Ok(self.seq)
    }
}

/// Gathers every put waiting, replicates them as one batch, and answers them.
fn writer(requests: mpsc::Receiver<Pending>, mut replicator: Replicator) -> Result<(), FloorError> {
    let mut batch = Vec::new();
    while let Ok(first) = requests.recv() {
        batch.push(first);
        batch.extend(requests.try_iter());
        let seq = replicator.replicate(batch.iter().map(|p| p.record.as_slice()))?;
        for pending in batch.drain(..) {
            let _ = pending.done.send(seq);
        }
    }
    Ok(())
}

/// Where a put's record goes: to the writer thread, or replicated on the gRPC worker itself.
enum PutPath {
    WriterThread(mpsc::Sender<Pending>),
    Inline(std::sync::Mutex<Replicator>),
}

struct FloorKv {
    path: PutPath,
}

#[tonic::async_trait]
impl Kv for FloorKv {
    async fn put(&self, request: Request<PutRequest>) -> Result<Response<PutResponse>, Status> {
        let record = request.into_inner().encode_to_vec();
        let revision = match &self.path {
            PutPath::WriterThread(writer) => {
                let (done, answered) = oneshot::channel();
                writer
                    .send(Pending { record, done })
                    .map_err(|_| Status::unavailable("the writer thread stopped"))?;
                answered
                    .await
                    .map_err(|_| Status::unavailable("the writer thread stopped"))?
            }
            PutPath::Inline(replicator) => {
                let mut replicator = replicator
                    .lock()
                    .map_err(|_| Status::unavailable("an earlier put failed"))?;
                match replicator.replicate(std::iter::once(record.as_slice())) {
                    Ok(seq) => seq,
                    Err(error) => {
                        eprintln!("put-floor leader: {error}");
                        std::process::exit(1);
                    }
                }
            }
        };
        Ok(Response::new(PutResponse {
            header: Some(ResponseHeader {
                revision: revision as i64,
                ..Default::default()
            }),
            prev_kv: None,
        }))
    }

    async fn range(&self, _: Request<RangeRequest>) -> Result<Response<RangeResponse>, Status> {
        Err(Status::unimplemented("put-floor serves KV.Put only"))
    }

    async fn delete_range(
        &self,
        _: Request<DeleteRangeRequest>,
    ) -> Result<Response<DeleteRangeResponse>, Status> {
        Err(Status::unimplemented("put-floor serves KV.Put only"))
    }

    async fn txn(&self, _: Request<TxnRequest>) -> Result<Response<TxnResponse>, Status> {
        Err(Status::unimplemented("put-floor serves KV.Put only"))
    }

    async fn compact(
        &self,
        _: Request<CompactionRequest>,
    ) -> Result<Response<CompactionResponse>, Status> {
        Err(Status::unimplemented("put-floor serves KV.Put only"))
    }
}

fn leader(
    listen: SocketAddr,
    followers: Vec<SocketAddr>,
    dir: PathBuf,
    inline: bool,
    log_mib: u64,
) -> Result<(), FloorError> {
    if followers.len() != 2 {
        return Err(FloorError::Usage(format!(
            "--followers needs two addresses, got {}",
            followers.len()
        )));
    }
    let replicator = Replicator::start(&followers, &dir, log_mib)?;
    let path = if inline {
        PutPath::Inline(std::sync::Mutex::new(replicator))
    } else {
        let (to_writer, requests) = mpsc::channel();
        // A writer that stops (a follower gone, the disk failing) ends the process: the floor
        // measures a healthy path only.
        thread::spawn(move || {
            if let Err(error) = writer(requests, replicator) {
                eprintln!("put-floor leader: {error}");
                std::process::exit(1);
            }
        });
        PutPath::WriterThread(to_writer)
    };
    // One async worker, as `conclave serve` runs on two CPUs beside its Raft driver thread.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(FloorError::Runtime)?;
    let served = runtime.block_on(
        tonic::transport::Server::builder()
            .tcp_nodelay(true)
            .add_service(KvServer::new(FloorKv { path }))
            .serve(listen),
    );
    Ok(served?)
}

fn main() {
    let args = Args::parse();
    let log_mib = args.log_mib;
    let result = if !(1..=LOG_FILE_MIB_MAX).contains(&log_mib) {
        Err(FloorError::Usage(format!(
            "--log-mib must be 1 to {LOG_FILE_MIB_MAX}, got {log_mib}"
        )))
    } else {
        match args.role {
            Role::Follower { listen, dir } => follower(listen, &dir, log_mib),
            Role::Leader {
                listen,
                followers,
                dir,
                inline,
            } => leader(listen, followers, dir, inline, log_mib),
        }
    };
    if let Err(error) = result {
        eprintln!("put-floor: {error}");
        std::process::exit(1);
    }
}
