//! The layer and its builder.

use std::collections::HashMap;
use std::sync::Arc;

use http::HeaderName;
use idemkit_core::{InFlightBehavior, IntoKeyStore, KeyStore, Policy, PolicyError};
use idemkit_engine::AccountResolver;
use idemkit_engine::Engine;
#[cfg(test)]
use idemkit_engine::Unscoped;
use tower::Layer;

use crate::IDEMPOTENCY_KEY;
use crate::service::Idempotency;

/// Where a method's key comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KeyField {
    /// Only the key metadata.
    Metadata,
    /// This string field of the request message; the key metadata when the
    /// field is empty. `uuid4`: the field's value must be a UUID4 (AIP-155).
    Field {
        /// The field number.
        number: u32,
        /// Whether a value in the field must be a UUID4.
        uuid4: bool,
    },
}

/// A key field named in the builder, resolved against the descriptors at build.
#[derive(Debug, Clone)]
struct NamedField {
    path: String,
    name: String,
    uuid4: bool,
}

pub(crate) struct Shared {
    pub(crate) engine: Engine,
    pub(crate) resolver: Arc<dyn AccountResolver>,
    pub(crate) key_metadata: HeaderName,
    pub(crate) methods: HashMap<String, KeyField>,
    pub(crate) max_request_message: usize,
}

/// A tower [`Layer`] for tonic servers (`Server::builder().layer(..)`) that
/// makes the configured unary methods require an idempotency key and enforces
/// the idemkit contract on them (lease mode: the claim commits as `in_flight`
/// with a heartbeat-kept lease, the answer is stored with a fenced write).
/// Other methods pass through untouched.
#[derive(Clone)]
pub struct IdempotencyLayer {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("engine", &self.shared.engine)
            .field("methods", &self.shared.methods)
            .finish_non_exhaustive()
    }
}

impl IdempotencyLayer {
    /// Starts a layer over any key store (lease mode, the only one gRPC has),
    /// with the resolver that scopes keys per account: the same
    /// [`AccountResolver`] as the HTTP layer's, over the call's HTTP/2 request
    /// parts (metadata are its headers; an auth layer's extensions are there).
    /// A refusal is answered as the status its code maps to (`Unauthorized`:
    /// `UNAUTHENTICATED`).
    pub fn lease(store: impl IntoKeyStore, resolver: impl AccountResolver) -> IdempotencyLayerBuilder {
        IdempotencyLayerBuilder {
            store: store.into_key_store(),
            policy: Policy::new(),
            resolver: Arc::new(resolver),
            key_metadata: HeaderName::from_static(IDEMPOTENCY_KEY),
            methods: HashMap::new(),
            named: Vec::new(),
            descriptors: None,
            max_request_message: 4 * 1024 * 1024,
        }
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = Idempotency<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency::new(inner, self.shared.clone())
    }
}

/// Why a layer could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BuildError {
    /// The policy breaks an invariant of the contract.
    #[error(transparent)]
    Policy(#[from] PolicyError),
    /// No method was named.
    #[error(
        "name the unary methods that take idempotency keys with `.unary(..)` or `.unary_with_key_field(..)`"
    )]
    NoMethods,
    /// A method is not a full method name.
    #[error("`{0}` is not a full gRPC method name such as `/pkg.Service/Method`")]
    BadMethod(String),
    /// The `accepted` in-flight behaviour (`202` with a status URL) has no gRPC form.
    #[error("the `accepted` in-flight behaviour is HTTP-only; use reject or wait")]
    AcceptedInFlight,
    /// The encoded file descriptor set does not decode.
    #[error("the file descriptor set does not decode: {0}")]
    Descriptors(String),
    /// A key field was named but no descriptors were given to resolve it.
    #[error(
        "`{0}` names its key field by name: give the service's encoded file descriptor set with `.file_descriptor_set(..)`"
    )]
    NoDescriptors(String),
    /// A configured method is not in the descriptors.
    #[error("`{0}` is not a method of the given file descriptor set")]
    UnknownMethod(String),
    /// A named key field is not a top-level singular `string` field of the
    /// method's request message.
    #[error("`{path}`: `{field}` is not a top-level singular `string` field of its request message")]
    BadKeyField {
        /// The method.
        path: String,
        /// The field name.
        field: String,
    },
    /// A keyed method streams: its answers cannot be stored and replayed as one
    /// message, so the layer refuses it at start-up instead of buffering or
    /// replaying part of a stream.
    #[error(
        "`{0}` is a streaming method: idempotency keys are supported on unary methods only (a stream cannot be stored and replayed faithfully); remove it from the layer"
    )]
    StreamingMethod(String),
}

/// Builds an [`IdempotencyLayer`]; [`IdempotencyLayerBuilder::build`] validates.
pub struct IdempotencyLayerBuilder {
    store: Arc<dyn KeyStore>,
    policy: Policy,
    resolver: Arc<dyn AccountResolver>,
    key_metadata: HeaderName,
    methods: HashMap<String, KeyField>,
    named: Vec<NamedField>,
    descriptors: Option<Vec<u8>>,
    max_request_message: usize,
}

impl std::fmt::Debug for IdempotencyLayerBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyLayerBuilder")
            .field("policy", &self.policy)
            .field("methods", &self.methods)
            .finish_non_exhaustive()
    }
}

impl IdempotencyLayerBuilder {
    /// Sets the policy (windows, lease, in-flight and server-error behaviour, …).
    pub fn policy(mut self, policy: Policy) -> Self {
        self.policy = policy;
        self
    }

    /// Reads the key from another metadata entry (default `idempotency-key`).
    pub fn key_metadata(mut self, name: HeaderName) -> Self {
        self.key_metadata = name;
        self
    }

    /// Makes the unary method `path` (`/pkg.Service/Method`) require a key, read
    /// from the key metadata.
    pub fn unary(mut self, path: impl Into<String>) -> Self {
        self.methods.insert(path.into(), KeyField::Metadata);
        self
    }

    /// Makes the unary method `path` require a key, read from the top-level
    /// `string` field `number` of its request message (the field the API
    /// defines), or from the key metadata when that field is empty. A call that
    /// sets both to different keys is `INVALID_ARGUMENT`.
    pub fn unary_with_key_field(mut self, path: impl Into<String>, number: u32) -> Self {
        self.methods
            .insert(path.into(), KeyField::Field { number, uuid4: false });
        self
    }

    /// The service's encoded `FileDescriptorSet` (what `tonic-prost-build`
    /// writes with `file_descriptor_set_path`, and server reflection serves):
    /// it resolves key fields named with [`Self::unary_with_key_field_name`] and
    /// [`Self::unary_with_request_id`], and lets [`Self::build`] refuse
    /// streaming methods.
    pub fn file_descriptor_set(mut self, encoded: impl AsRef<[u8]>) -> Self {
        self.descriptors = Some(encoded.as_ref().to_vec());
        self
    }

    /// [`Self::unary_with_key_field`] with the field named (`idempotency_key`)
    /// instead of numbered, resolved from [`Self::file_descriptor_set`] at build.
    pub fn unary_with_key_field_name(mut self, path: impl Into<String>, name: impl Into<String>) -> Self {
        self.named.push(NamedField {
            path: path.into(),
            name: name.into(),
            uuid4: false,
        });
        self
    }

    /// The AIP-155 form: the key is the request message's `string` field `name`
    /// (usually `request_id`), resolved from [`Self::file_descriptor_set`], and a
    /// value in it must be a UUID4 (the format AIP-155 annotates it with), else
    /// `INVALID_ARGUMENT idempotency_key_invalid`. An empty field falls back to
    /// the key metadata, as with [`Self::unary_with_key_field`].
    ///
    /// As AIP-155 notes, a duplicate gets the **first** answer again (the
    /// resource as it was then), not the resource's current state: a "stale
    /// success" within the replay window. Read the resource to see it now.
    pub fn unary_with_request_id(mut self, path: impl Into<String>, name: impl Into<String>) -> Self {
        self.named.push(NamedField {
            path: path.into(),
            name: name.into(),
            uuid4: true,
        });
        self
    }

    /// Largest request message accepted (default 4 MiB, tonic's default);
    /// larger is `RESOURCE_EXHAUSTED`.
    pub fn max_request_message(mut self, bytes: usize) -> Self {
        self.max_request_message = bytes;
        self
    }

    /// Validates and builds: with [`Self::file_descriptor_set`], named key
    /// fields are resolved, and a keyed method that is not in the descriptors
    /// or streams (client or server side) is refused
    /// ([`BuildError::StreamingMethod`]).
    pub fn build(mut self) -> Result<IdempotencyLayer, BuildError> {
        if self.policy.in_flight == InFlightBehavior::Accepted {
            return Err(BuildError::AcceptedInFlight);
        }
        let pool = match &self.descriptors {
            Some(bytes) => Some(
                prost_reflect::DescriptorPool::decode(bytes.as_slice())
                    .map_err(|e| BuildError::Descriptors(e.to_string()))?,
            ),
            None => None,
        };
        for named in std::mem::take(&mut self.named) {
            let pool = pool
                .as_ref()
                .ok_or_else(|| BuildError::NoDescriptors(named.path.clone()))?;
            let method = find_method(pool, &named.path)?;
            let field = method
                .input()
                .get_field_by_name(&named.name)
                .filter(|f| matches!(f.kind(), prost_reflect::Kind::String) && !f.is_list() && !f.is_map())
                .ok_or_else(|| BuildError::BadKeyField {
                    path: named.path.clone(),
                    field: named.name.clone(),
                })?;
            self.methods.insert(
                named.path,
                KeyField::Field {
                    number: field.number(),
                    uuid4: named.uuid4,
                },
            );
        }
        if let Some(pool) = &pool {
            for path in self.methods.keys() {
                if !is_method_path(path) {
                    return Err(BuildError::BadMethod(path.clone()));
                }
                let method = find_method(pool, path)?;
                if method.is_server_streaming() || method.is_client_streaming() {
                    return Err(BuildError::StreamingMethod(path.clone()));
                }
            }
        }
        if self.methods.is_empty() {
            return Err(BuildError::NoMethods);
        }
        if let Some(bad) = self.methods.keys().find(|m| !is_method_path(m)) {
            return Err(BuildError::BadMethod(bad.clone()));
        }
        Ok(IdempotencyLayer {
            shared: Arc::new(Shared {
                engine: Engine::lease(self.store, self.policy)?,
                resolver: self.resolver,
                key_metadata: self.key_metadata,
                methods: self.methods,
                max_request_message: self.max_request_message,
            }),
        })
    }
}

/// The method `/pkg.Service/Method` in `pool`.
fn find_method(
    pool: &prost_reflect::DescriptorPool,
    path: &str,
) -> Result<prost_reflect::MethodDescriptor, BuildError> {
    let unknown = || BuildError::UnknownMethod(path.to_owned());
    let (service, method) = path
        .strip_prefix('/')
        .and_then(|p| p.split_once('/'))
        .ok_or_else(|| BuildError::BadMethod(path.to_owned()))?;
    pool.get_service_by_name(service)
        .ok_or_else(unknown)?
        .methods()
        .find(|m| m.name() == method)
        .ok_or_else(unknown)
}

fn is_method_path(p: &str) -> bool {
    let Some(rest) = p.strip_prefix('/') else {
        return false;
    };
    matches!(rest.split_once('/'), Some((svc, m)) if !svc.is_empty() && !m.is_empty() && !m.contains('/'))
}

#[cfg(test)]
mod tests {
    use prost_reflect::prost::Message as _;
    use prost_reflect::prost_types::{
        DescriptorProto, FieldDescriptorProto, FileDescriptorProto, FileDescriptorSet, MethodDescriptorProto,
        ServiceDescriptorProto, field_descriptor_proto::Type,
    };

    use super::*;

    /// `t.v1.S` with a unary `Create`, a server-streaming `Watch` and a
    /// client-streaming `Upload`, all taking `Req { string request_id = 7; int32 n = 2; }`.
    fn descriptors() -> Vec<u8> {
        let field = |name: &str, number: i32, ty: Type| FieldDescriptorProto {
            name: Some(name.into()),
            number: Some(number),
            r#type: Some(ty as i32),
            json_name: Some(name.into()),
            ..Default::default()
        };
        let method = |name: &str, client: bool, server: bool| MethodDescriptorProto {
            name: Some(name.into()),
            input_type: Some(".t.v1.Req".into()),
            output_type: Some(".t.v1.Req".into()),
            client_streaming: Some(client),
            server_streaming: Some(server),
            ..Default::default()
        };
        FileDescriptorSet {
            file: vec![FileDescriptorProto {
                name: Some("t.proto".into()),
                package: Some("t.v1".into()),
                syntax: Some("proto3".into()),
                message_type: vec![DescriptorProto {
                    name: Some("Req".into()),
                    field: vec![field("request_id", 7, Type::String), field("n", 2, Type::Int32)],
                    ..Default::default()
                }],
                service: vec![ServiceDescriptorProto {
                    name: Some("S".into()),
                    method: vec![
                        method("Create", false, false),
                        method("Watch", false, true),
                        method("Upload", true, false),
                    ],
                    ..Default::default()
                }],
                ..Default::default()
            }],
        }
        .encode_to_vec()
    }

    fn builder() -> IdempotencyLayerBuilder {
        IdempotencyLayer::lease(Arc::new(idemkit_testkit::MemoryStore::new()), Unscoped)
            .file_descriptor_set(descriptors())
    }

    #[test]
    fn key_fields_are_resolved_by_name_from_the_descriptors() {
        let layer = builder()
            .unary_with_request_id("/t.v1.S/Create", "request_id")
            .build()
            .unwrap();
        assert_eq!(
            layer.shared.methods["/t.v1.S/Create"],
            KeyField::Field {
                number: 7,
                uuid4: true
            }
        );
        for (field, why) in [("n", "not a string"), ("nope", "absent")] {
            let err = builder()
                .unary_with_key_field_name("/t.v1.S/Create", field)
                .build()
                .unwrap_err();
            assert!(matches!(err, BuildError::BadKeyField { .. }), "{why}: {err}");
        }
        let err = IdempotencyLayer::lease(Arc::new(idemkit_testkit::MemoryStore::new()), Unscoped)
            .unary_with_request_id("/t.v1.S/Create", "request_id")
            .build()
            .unwrap_err();
        assert!(matches!(err, BuildError::NoDescriptors(_)), "{err}");
        let err = builder().unary("/t.v1.S/Missing").build().unwrap_err();
        assert!(matches!(err, BuildError::UnknownMethod(_)), "{err}");
    }

    #[test]
    fn streaming_methods_are_refused_at_build() {
        for method in ["/t.v1.S/Watch", "/t.v1.S/Upload"] {
            let err = builder().unary(method).build().unwrap_err();
            assert!(matches!(err, BuildError::StreamingMethod(_)), "{method}: {err}");
            assert!(err.to_string().contains("streaming method"), "{err}");
        }
        assert!(builder().unary("/t.v1.S/Create").build().is_ok());
    }
}
