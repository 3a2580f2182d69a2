//! `gpupool-device-plugin`: the kubelet device plugin binary.
fn main() {}
