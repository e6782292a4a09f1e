//! etcd's Maintenance service: Status (what `etcdctl endpoint status` shows), Alarm (always
//! an empty list: Conclave raises no space or corruption alarms), Snapshot, MoveLeader.

use std::io::{self, Write};
use std::sync::Arc;

use conclave_proto::etcdserverpb::{self as pb, maintenance_server::Maintenance};
use conclave_raft::Role;
use conclave_state::StateMachine;
use sha2::{Digest, Sha256};
use tokio::sync::{Semaphore, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Status, async_trait};

use super::{Api, CallContext, to_status};
use crate::error::Error;
use crate::node::dir_size_bytes;

/// The etcd version Conclave reports: clients (etcdctl 3.4) gate features on it.
pub const ETCD_VERSION: &str = "3.4.0";
/// Snapshot stream blobs are at most this big (etcd sends 32 KiB pieces).
const SNAPSHOT_BLOB_BYTES_MAX: usize = 32 * 1024;
/// Blobs a `Maintenance.Snapshot` call encodes ahead of its client at most. The image is
/// encoded while it is sent, so a call holds about this many blobs (512 KiB), not the image.
pub const SNAPSHOT_STREAM_BLOBS_AHEAD: usize = 16;
/// `Maintenance.Snapshot` calls a member streams at once at most. Each holds a blocking
/// thread and a clone of the state while its client reads; one more is refused with
/// RESOURCE_EXHAUSTED until one ends.
pub const SNAPSHOT_CALLS_MAX: usize = 4;

/// The stream ends with the image padded with zeros to a multiple of this, then the SHA-256
/// of everything before it: `etcdctl snapshot save` (3.4) refuses a stream whose length is
/// not a multiple of 512 plus the 32 bytes of a SHA-256, as etcd's own snapshots are.
const SNAPSHOT_TRAILER_ALIGN_BYTES: u64 = 512;

type SnapshotBlobs = mpsc::Sender<Result<pb::SnapshotResponse, Status>>;

pub struct MaintenanceService {
    api: Arc<Api>,
    snapshot_calls: Arc<Semaphore>,
}

impl MaintenanceService {
    pub fn new(api: Arc<Api>) -> Self {
        MaintenanceService {
            api,
            snapshot_calls: Arc::new(Semaphore::new(SNAPSHOT_CALLS_MAX)),
        }
    }
}

#[async_trait]
impl Maintenance for MaintenanceService {
    async fn alarm(
        &self,
        _request: tonic::Request<pb::AlarmRequest>,
    ) -> Result<tonic::Response<pb::AlarmResponse>, Status> {
        Ok(tonic::Response::new(pb::AlarmResponse {
            header: Some(self.api.read_header()),
            alarms: Vec::new(),
        }))
    }

    async fn status(
        &self,
        _request: tonic::Request<pb::StatusRequest>,
    ) -> Result<tonic::Response<pb::StatusResponse>, Status> {
        let status = self.api.node.status();
        let db_size = dir_size_bytes(&self.api.config.data_dir) as i64;
        let mut errors = Vec::new();
        if status.leader.is_none() {
            errors.push(Error::NoLeader.to_string());
        }
        Ok(tonic::Response::new(pb::StatusResponse {
            header: Some(self.api.read_header()),
            version: ETCD_VERSION.to_string(),
            db_size,
            leader: status.leader.unwrap_or(0),
            raft_index: status.commit_index,
            raft_term: status.term,
            raft_applied_index: status.applied_index,
            errors,
            db_size_in_use: db_size,
            is_learner: status.conf_state.learners.contains(&self.api.config.id),
            storage_version: String::new(),
            db_size_quota: 0,
            downgrade_info: None,
        }))
    }

    type SnapshotStream = ReceiverStream<Result<pb::SnapshotResponse, Status>>;

    async fn snapshot(
        &self,
        request: tonic::Request<pb::SnapshotRequest>,
    ) -> Result<tonic::Response<Self::SnapshotStream>, Status> {
        // The image holds password hashes and the token key: root only once auth is on.
        let ctx = CallContext::new(&request, self.api.config.request_timeout_ms);
        self.api.check_admin(&ctx)?;
        let Ok(permit) = self.snapshot_calls.clone().try_acquire_owned() else {
            return Err(Status::resource_exhausted(format!(
                "conclave: resource exhausted: {SNAPSHOT_CALLS_MAX} snapshots are being streamed \
                 already; retry once one ends"
            )));
        };
        // Only a clone is taken under the state lock (O(1) for the key-value store, a
        // persistent map), so the driver is not held up while the image is encoded.
        let frozen = self.api.node.read_state(|state| state.clone());
        let header = self.api.read_header();
        let (blobs, stream) = mpsc::channel(SNAPSHOT_STREAM_BLOBS_AHEAD);
        let on_panic = blobs.clone();
        let encoder = tokio::task::spawn_blocking(move || {
            stream_snapshot(&frozen, header, blobs);
            drop(permit);
        });
        // An encoder that panicked (a state invariant broken) must end the stream with an
        // error: ending it quietly would look like a complete, empty image to etcdctl.
        tokio::spawn(async move {
            if let Err(stopped) = encoder.await {
                let status = Status::internal(format!("the snapshot encoder stopped: {stopped}"));
                let _ = on_panic.send(Err(status)).await;
            }
        });
        Ok(tonic::Response::new(ReceiverStream::new(stream)))
    }

    async fn move_leader(
        &self,
        request: tonic::Request<pb::MoveLeaderRequest>,
    ) -> Result<tonic::Response<pb::MoveLeaderResponse>, Status> {
        let ctx = CallContext::new(&request, self.api.config.request_timeout_ms);
        self.api.check_admin(&ctx)?;
        let target = request.into_inner().target_id;
        let status = self.api.node.status();
        if status.role != Some(Role::Leader) {
            return Err(Status::failed_precondition("etcdserver: not leader"));
        }
        self.api
            .node
            .transfer_leader(target)
            .await
            .map_err(|e| match e {
                Error::Raft(conclave_raft::Error::InvalidTransferTarget(_)) => {
                    Status::failed_precondition("etcdserver: bad leader transferee")
                }
                other => to_status(other),
            })?;
        // etcd answers once the target leads.
        let mut watch = self.api.node.status.clone();
        loop {
            if watch.borrow_and_update().leader == Some(target) {
                break;
            }
            if ctx.remaining().is_zero()
                || tokio::time::timeout(ctx.remaining(), watch.changed())
                    .await
                    .is_err()
            {
                return Err(Status::unavailable(
                    "etcdserver: leadership transfer timed out",
                ));
            }
        }
        Ok(tonic::Response::new(pb::MoveLeaderResponse {
            header: Some(self.api.read_header()),
        }))
    }
}

/// The length of a snapshot stream whose image is `image_bytes` long: the image, zeros to the
/// next multiple of [`SNAPSHOT_TRAILER_ALIGN_BYTES`], and a SHA-256.
fn snapshot_stream_bytes(image_bytes: u64) -> u64 {
    image_bytes.next_multiple_of(SNAPSHOT_TRAILER_ALIGN_BYTES) + Sha256::output_size() as u64
}

/// Encodes `state` into `blobs` as `Maintenance.Snapshot` blobs, on a blocking thread, with
/// the padding and checksum etcd's clients expect at the end. Each blob says how many bytes
/// follow it, so the image is encoded twice: once only to count its bytes, then into the
/// stream, a blob at a time. `state` is a clone nobody writes to, so both passes give the
/// same bytes (the second checks it). A client that stops reading ends the encoding; any
/// other failure ends the stream with an error status.
fn stream_snapshot(state: &StateMachine, header: pb::ResponseHeader, blobs: SnapshotBlobs) {
    let encoded = state
        .snapshot(ByteCounter::default())
        .map_err(|e| e.to_string())
        .and_then(|counter| {
            let writer = BlobWriter {
                blobs: blobs.clone(),
                header,
                remaining_bytes: snapshot_stream_bytes(counter.bytes),
                written_bytes: 0,
                checksum: Sha256::new(),
                pending: Vec::with_capacity(SNAPSHOT_BLOB_BYTES_MAX),
            };
            state.snapshot(writer).map_err(|e| e.to_string())
        })
        .and_then(|writer| writer.finish().map_err(|e| e.to_string()));
    if let Err(reason) = encoded
        && !blobs.is_closed()
    {
        let status = Status::internal(format!("the snapshot could not be encoded: {reason}"));
        let _ = blobs.blocking_send(Err(status));
    }
}

/// Counts the bytes written to it: the size of a snapshot image without holding it.
#[derive(Default)]
struct ByteCounter {
    bytes: u64,
}

impl Write for ByteCounter {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        self.bytes += bytes.len() as u64;
        Ok(bytes.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Cuts a snapshot image into stream blobs as it is encoded, waiting while the client is
/// [`SNAPSHOT_STREAM_BLOBS_AHEAD`] blobs behind.
struct BlobWriter {
    blobs: SnapshotBlobs,
    header: pb::ResponseHeader,
    /// Bytes of the stream not yet handed to it.
    remaining_bytes: u64,
    /// Bytes of the image (then its padding) written so far, all of them in `checksum`.
    written_bytes: u64,
    checksum: Sha256,
    pending: Vec<u8>,
}

impl BlobWriter {
    fn send_pending(&mut self) -> io::Result<()> {
        self.remaining_bytes = self
            .remaining_bytes
            .checked_sub(self.pending.len() as u64)
            .ok_or_else(|| io::Error::other("the snapshot came out longer than counted"))?;
        let blob = std::mem::replace(
            &mut self.pending,
            Vec::with_capacity(SNAPSHOT_BLOB_BYTES_MAX),
        );
        let response = pb::SnapshotResponse {
            header: Some(self.header),
            remaining_bytes: self.remaining_bytes,
            blob: blob.into(),
            version: ETCD_VERSION.to_string(),
        };
        self.blobs
            .blocking_send(Ok(response))
            .map_err(|_| io::Error::new(io::ErrorKind::BrokenPipe, "the client stopped reading"))
    }

    /// Pads the image, appends its checksum and sends the last blob; the stream must have
    /// been exactly as long as counted.
    fn finish(mut self) -> io::Result<()> {
        let padding_bytes = self
            .written_bytes
            .next_multiple_of(SNAPSHOT_TRAILER_ALIGN_BYTES)
            - self.written_bytes;
        self.write_all(&vec![0; padding_bytes as usize])?;
        let checksum = std::mem::take(&mut self.checksum).finalize();
        self.pending.extend_from_slice(&checksum);
        while !self.pending.is_empty() {
            let rest = self
                .pending
                .split_off(self.pending.len().min(SNAPSHOT_BLOB_BYTES_MAX));
            self.send_pending()?;
            self.pending = rest;
        }
        if self.remaining_bytes != 0 {
            return Err(io::Error::other(
                "the snapshot came out shorter than counted",
            ));
        }
        Ok(())
    }
}

impl Write for BlobWriter {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        let room = SNAPSHOT_BLOB_BYTES_MAX - self.pending.len();
        let taken = bytes.len().min(room);
        self.pending.extend_from_slice(&bytes[..taken]);
        self.checksum.update(&bytes[..taken]);
        self.written_bytes += taken as u64;
        if self.pending.len() == SNAPSHOT_BLOB_BYTES_MAX {
            self.send_pending()?;
        }
        Ok(taken)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use conclave_state::txn::PutRequest;
    use conclave_state::{Command, Config, Request};

    use super::*;

    fn machine_with_keys(count: u64) -> StateMachine {
        let mut machine = StateMachine::new(Config::default());
        for index in 1..=count {
            let put = PutRequest::new(format!("k/{index}"), vec![b'v'; 256]);
            machine.apply(index, &Command::new(1_000 + index, Request::Put(put)));
        }
        machine
    }

    /// The stream is the image, zeros to a multiple of 512 bytes and their SHA-256 (what
    /// etcdctl checks for), blob by blob, each saying how many bytes follow it, with the
    /// encoder held back by the client (the image is many times what may be queued).
    #[test]
    fn a_streamed_snapshot_is_the_image_and_its_checksum_and_counts_down_to_zero() {
        let machine = machine_with_keys(10_000);
        let mut image = machine.snapshot_to_vec();
        image.resize(image.len().next_multiple_of(512), 0);
        let checksum = Sha256::digest(&image);
        image.extend_from_slice(&checksum);
        assert_eq!(image.len() % 512, 32, "etcdctl's test for a checksum");
        assert!(image.len() > 2 * SNAPSHOT_STREAM_BLOBS_AHEAD * SNAPSHOT_BLOB_BYTES_MAX);
        let (blobs, mut stream) = mpsc::channel(SNAPSHOT_STREAM_BLOBS_AHEAD);
        let encoder = std::thread::spawn(move || {
            stream_snapshot(&machine, pb::ResponseHeader::default(), blobs)
        });
        let mut received = Vec::new();
        while let Some(response) = stream.blocking_recv() {
            let response = response.expect("no error in the stream");
            assert!(!response.blob.is_empty() && response.blob.len() <= SNAPSHOT_BLOB_BYTES_MAX);
            received.extend_from_slice(&response.blob);
            assert_eq!(
                response.remaining_bytes,
                (image.len() - received.len()) as u64,
                "remaining_bytes after {} bytes",
                received.len()
            );
        }
        encoder.join().expect("the encoder ends");
        assert_eq!(received, image);
    }

    /// A client that goes away mid-stream stops the encoder instead of leaving it blocked.
    #[test]
    fn a_client_that_stops_reading_ends_the_encoding() {
        let machine = machine_with_keys(10_000);
        let (blobs, mut stream) = mpsc::channel(SNAPSHOT_STREAM_BLOBS_AHEAD);
        let encoder = std::thread::spawn(move || {
            stream_snapshot(&machine, pb::ResponseHeader::default(), blobs)
        });
        let first = stream.blocking_recv().expect("a first blob");
        assert!(first.is_ok());
        drop(stream);
        encoder
            .join()
            .expect("the encoder ends once its client is gone");
    }

    /// An image that does not come out as long as counted ends the stream with an error,
    /// never with a blob whose remaining_bytes is wrong.
    #[test]
    fn an_image_longer_than_counted_is_an_error() {
        let (blobs, mut stream) = mpsc::channel(4);
        let mut writer = BlobWriter {
            blobs,
            header: pb::ResponseHeader::default(),
            remaining_bytes: snapshot_stream_bytes(10),
            written_bytes: 0,
            checksum: Sha256::new(),
            pending: Vec::new(),
        };
        writer.write_all(&[7; 600]).expect("buffered");
        assert!(writer.finish().is_err());
        assert!(stream.try_recv().is_err(), "nothing was sent");
    }
}
