//! Compiles the CSI v1 protobuf (proto/csi.proto) into the server and client code of
//! its services, with protoc (Debian's `protobuf-compiler`; `PROTOC` names another).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/csi.proto");
    tonic_prost_build::configure().compile_protos(&["proto/csi.proto"], &["proto"])?;
    Ok(())
}
