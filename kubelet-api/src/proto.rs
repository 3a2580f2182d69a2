//! Types, clients and servers generated from the kubelet's protos in
//! `kubelet-api/proto/` (the wire contract with every kubelet).

/// The kubelet's device-plugin API (`Registration`, `DevicePlugin`).
pub mod deviceplugin {
    /// Version v1beta1, the one every supported kubelet speaks.
    #[allow(missing_docs, clippy::all)]
    pub mod v1beta1 {
        tonic::include_proto!("v1beta1");
    }
}

/// The kubelet's PodResources API (`PodResourcesLister`).
pub mod podresources {
    /// Version v1.
    #[allow(missing_docs, clippy::all)]
    pub mod v1 {
        tonic::include_proto!("v1");
    }
}
