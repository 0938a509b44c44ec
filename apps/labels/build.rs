//! Compiles `proto/labels/v1/labels.proto` with protox (a pure-Rust protobuf
//! compiler: no `protoc` binary, no network) into the tonic service and client,
//! and writes the encoded descriptor set that gRPC server reflection serves.

use prost::Message;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    let fds = protox::compile(["labels/v1/labels.proto"], ["proto"])?;
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out.join("labels_descriptor.bin"), fds.encode_to_vec())?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .build_transport(false)
        .compile_fds(fds)?;
    Ok(())
}
