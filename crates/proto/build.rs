//! Compiles `proto/` at the workspace root with protox (a pure-Rust protobuf compiler), so a
//! build needs no `protoc` on the machine.

use std::path::PathBuf;

/// Every file we serve, relative to `proto/`. Imports resolve against the same root.
const PROTO_FILES: &[&str] = &[
    "mvccpb/kv.proto",
    "etcdserverpb/rpc.proto",
    "authpb/auth.proto",
    "etcdserverpb/auth.proto",
    "v3lockpb/v3lock.proto",
    "v3electionpb/v3election.proto",
    "conclave/v1/conclave.proto",
    "conclave/v1/queue.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let manifest_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    let proto_root = manifest_dir.join("../../proto");
    println!("cargo:rerun-if-changed={}", proto_root.display());
    for file in PROTO_FILES {
        println!("cargo:rerun-if-changed={}", proto_root.join(file).display());
    }

    let descriptors = protox::compile(PROTO_FILES, [&proto_root])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        // Keys, values and blobs as `Bytes`: the server slices and forwards them without copies.
        .bytes(".")
        .compile_fds(descriptors)?;
    Ok(())
}
