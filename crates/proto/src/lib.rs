//! Conclave's gRPC API, generated at build time from `proto/` at the workspace root.
//!
//! - [`mvccpb`], [`etcdserverpb`], [`authpb`], [`v3lockpb`], [`v3electionpb`]: the subset of etcd's v3 API
//!   that Conclave serves. Package, service, message names and field numbers are etcd's, so
//!   the gRPC paths (`/etcdserverpb.KV/Range`, `/v3lockpb.Lock/Lock`, …) and the wire bytes
//!   are what etcd clients expect.
//! - [`conclave::v1`]: Conclave's own services (priority elections, topics, cluster status).
//!
//! Each package module holds the messages plus `<service>_client` and `<service>_server`
//! modules with tonic client and server stubs.

// Generated code follows prost's and tonic's conventions, not ours.
#[allow(clippy::all, clippy::pedantic, missing_docs, rustdoc::all)]
pub mod mvccpb {
    tonic::include_proto!("mvccpb");
}

#[allow(clippy::all, clippy::pedantic, missing_docs, rustdoc::all)]
pub mod authpb {
    tonic::include_proto!("authpb");
}

#[allow(clippy::all, clippy::pedantic, missing_docs, rustdoc::all)]
pub mod etcdserverpb {
    tonic::include_proto!("etcdserverpb");
}

#[allow(clippy::all, clippy::pedantic, missing_docs, rustdoc::all)]
pub mod v3lockpb {
    tonic::include_proto!("v3lockpb");
}

#[allow(clippy::all, clippy::pedantic, missing_docs, rustdoc::all)]
pub mod v3electionpb {
    tonic::include_proto!("v3electionpb");
}

/// Conclave's own API packages.
pub mod conclave {
    /// Version 1 of Conclave's own API (package `conclave.v1`).
    #[allow(clippy::all, clippy::pedantic, missing_docs, rustdoc::all)]
    pub mod v1 {
        tonic::include_proto!("conclave.v1");
    }
}

#[cfg(test)]
mod tests {
    use prost::Message;
    use tonic::server::NamedService;

    use super::etcdserverpb::{RangeRequest, range_request};

    /// Bytes an etcd client puts on the wire for
    /// `Range{key:"foo", range_end:"fop", limit:10, sort_order:DESCEND, serializable:true}`,
    /// worked out by hand from etcd's field numbers: (field << 3 | wire type), then the value.
    const RANGE_REQUEST_WIRE: &[u8] = &[
        0x0a, 3, b'f', b'o', b'o', // 1: key
        0x12, 3, b'f', b'o', b'p', // 2: range_end
        0x18, 10, // 3: limit
        0x28, 2, // 5: sort_order = DESCEND
        0x38, 1, // 7: serializable
    ];

    #[test]
    fn range_request_round_trips_with_etcd_field_numbers() {
        let request = RangeRequest {
            key: "foo".into(),
            range_end: "fop".into(),
            limit: 10,
            sort_order: range_request::SortOrder::Descend as i32,
            serializable: true,
            ..Default::default()
        };
        let encoded = request.encode_to_vec();
        assert_eq!(encoded, RANGE_REQUEST_WIRE);
        let decoded = RangeRequest::decode(RANGE_REQUEST_WIRE).expect("valid protobuf");
        assert_eq!(decoded, request);
        assert_eq!(decoded.sort_order(), range_request::SortOrder::Descend);
    }

    #[test]
    fn service_names_are_etcds() {
        use super::{conclave, etcdserverpb as pb, v3electionpb, v3lockpb};
        struct Unused;
        assert_eq!(
            <pb::kv_server::KvServer<Unused> as NamedService>::NAME,
            "etcdserverpb.KV"
        );
        assert_eq!(
            <pb::watch_server::WatchServer<Unused>>::NAME,
            "etcdserverpb.Watch"
        );
        assert_eq!(
            <pb::lease_server::LeaseServer<Unused>>::NAME,
            "etcdserverpb.Lease"
        );
        assert_eq!(
            <pb::cluster_server::ClusterServer<Unused>>::NAME,
            "etcdserverpb.Cluster"
        );
        assert_eq!(
            <pb::maintenance_server::MaintenanceServer<Unused>>::NAME,
            "etcdserverpb.Maintenance"
        );
        assert_eq!(
            <v3lockpb::lock_server::LockServer<Unused>>::NAME,
            "v3lockpb.Lock"
        );
        assert_eq!(
            <v3electionpb::election_server::ElectionServer<Unused>>::NAME,
            "v3electionpb.Election"
        );
        assert_eq!(
            <conclave::v1::election_server::ElectionServer<Unused>>::NAME,
            "conclave.v1.Election"
        );
    }

    /// The method paths the generated client calls and the server routes; etcd clients use
    /// exactly these strings.
    #[test]
    fn grpc_method_paths_match_etcd() {
        let generated = [
            include_str!(concat!(env!("OUT_DIR"), "/etcdserverpb.rs")),
            include_str!(concat!(env!("OUT_DIR"), "/v3lockpb.rs")),
            include_str!(concat!(env!("OUT_DIR"), "/v3electionpb.rs")),
            include_str!(concat!(env!("OUT_DIR"), "/conclave.v1.rs")),
        ]
        .concat();
        for path in [
            "/etcdserverpb.KV/Range",
            "/etcdserverpb.KV/Txn",
            "/etcdserverpb.Watch/Watch",
            "/etcdserverpb.Lease/LeaseGrant",
            "/etcdserverpb.Lease/LeaseKeepAlive",
            "/etcdserverpb.Cluster/MemberList",
            "/etcdserverpb.Maintenance/Status",
            "/etcdserverpb.Maintenance/MoveLeader",
            "/v3lockpb.Lock/Lock",
            "/v3electionpb.Election/Campaign",
            "/v3electionpb.Election/Observe",
            "/conclave.v1.Election/Campaign",
            "/conclave.v1.Topic/Inbox",
            "/conclave.v1.Status/ClusterStatus",
        ] {
            // Once in the client stub, once in the server's router.
            let quoted = format!("\"{path}\"");
            assert_eq!(generated.matches(&quoted).count(), 2, "{path}");
        }
    }
}
