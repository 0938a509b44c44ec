//! The labels API over gRPC: `proto/labels/v1/labels.proto` compiled at build
//! time by protox (no `protoc`, no network), its tonic server and client, the
//! encoded descriptor set served by reflection, and the proto3 JSON mapping.
//!
//! The proto3 JSON mapping of [`CreateLabelRequest`] is the REST `POST /labels`
//! body, and that of [`Label`] the REST label document, so one fixture serves
//! both protocols:
//!
//! ```
//! use idemkit_labels::proto::{self, CreateLabelRequest};
//!
//! let rest_body = r#"{"idempotencyKey":"label-4711","courier":"dhl",
//!   "shipFrom":{"name":"A","line1":"1 Main St","city":"Tokyo","postalCode":"100-0001","country":"JP"},
//!   "shipTo":{"name":"B","line1":"2 High St","city":"Berlin","postalCode":"10115","country":"DE"},
//!   "parcel":{"weightGrams":1200,"lengthCm":30,"widthCm":20,"heightCm":10}}"#;
//! let message: CreateLabelRequest = proto::from_json(rest_body).unwrap();
//! assert_eq!(message.idempotency_key, "label-4711");
//! assert_eq!(message.parcel.as_ref().unwrap().weight_grams, 1200);
//! ```

use std::sync::OnceLock;

use prost::Message;
use prost_reflect::{DescriptorPool, DynamicMessage, ReflectMessage as _};

/// The code tonic-prost-build generates from the proto (its items are
/// documented by the proto's comments; the lint allowances stay in here).
#[allow(missing_docs, unreachable_pub, clippy::all)]
mod generated {
    tonic::include_proto!("labels.v1");
}

pub use generated::*;

/// The encoded `FileDescriptorSet` of `labels.proto` (what reflection serves).
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/labels_descriptor.bin"));

/// The gRPC service name.
pub const SERVICE: &str = "labels.v1.Labels";

/// The full method name of `CreateLabel` (the idempotent one).
pub const CREATE_LABEL: &str = "/labels.v1.Labels/CreateLabel";

/// The field number of `CreateLabelRequest.idempotency_key`.
pub const KEY_FIELD_NUMBER: u32 = 1;

/// The AIP-155 form of label creation: the key is the `request_id` field
/// (a UUID4).
pub const CREATE_LABEL_WITH_REQUEST_ID: &str = "/labels.v1.Labels/CreateLabelWithRequestId";

/// The AIP-155 request id field of `CreateLabelWithRequestIdRequest`, by name
/// (the layer resolves its number from [`FILE_DESCRIPTOR_SET`]).
pub const REQUEST_ID_FIELD: &str = "request_id";

fn pool() -> &'static DescriptorPool {
    static POOL: OnceLock<DescriptorPool> = OnceLock::new();
    POOL.get_or_init(|| {
        DescriptorPool::decode(FILE_DESCRIPTOR_SET).expect("the built descriptor set decodes")
    })
}

/// A message that has a descriptor in `labels.proto`.
pub trait Described: Message + Default {
    /// Its full name (`labels.v1.Label`).
    const NAME: &'static str;
}

macro_rules! described {
    ($($t:ty => $n:literal),* $(,)?) => {
        $(impl Described for $t { const NAME: &'static str = $n; })*
    };
}

described!(
    CreateLabelRequest => "labels.v1.CreateLabelRequest",
    Label => "labels.v1.Label",
    Tracking => "labels.v1.Tracking",
    GetLabelRequest => "labels.v1.GetLabelRequest",
    GetTrackingRequest => "labels.v1.GetTrackingRequest",
    CreateLabelWithRequestIdRequest => "labels.v1.CreateLabelWithRequestIdRequest",
);

fn descriptor<M: Described>() -> prost_reflect::MessageDescriptor {
    pool()
        .get_message_by_name(M::NAME)
        .expect("every described message is in the descriptor set")
}

/// The message's proto3 JSON mapping (lowerCamelCase names, default values
/// left out).
pub fn to_json<M: Described>(message: &M) -> String {
    let dynamic = DynamicMessage::decode(descriptor::<M>(), message.encode_to_vec().as_slice())
        .expect("a message re-decodes with its own descriptor");
    debug_assert_eq!(dynamic.descriptor().full_name(), M::NAME);
    serde_json::to_string(&dynamic).expect("a dynamic message serializes")
}

/// The message from its proto3 JSON mapping (unknown fields are an error).
pub fn from_json<M: Described>(json: &str) -> Result<M, serde_json::Error> {
    let mut de = serde_json::Deserializer::from_str(json);
    let dynamic = DynamicMessage::deserialize(descriptor::<M>(), &mut de)?;
    de.end()?;
    Ok(dynamic.transcode_to().expect("the same message type"))
}
