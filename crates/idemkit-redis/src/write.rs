//! Business writes applied with a phase advance ([`crate::RedisStore::advance_with`]).

/// What a [`RedisWrite`] does to its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum WriteOp {
    /// `SET key value`.
    Set,
    /// `HSET key field value` (the key must be a hash or absent).
    HSet,
    /// `INCRBY key value` (the key must hold an integer or be absent).
    IncrBy,
    /// `SADD key value` (the key must be a set or absent).
    SAdd,
    /// `DEL key`.
    Del,
}

impl WriteOp {
    /// The Redis command's name.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Set => "SET",
            Self::HSet => "HSET",
            Self::IncrBy => "INCRBY",
            Self::SAdd => "SADD",
            Self::Del => "DEL",
        }
    }
}

/// One write to one of the application's keys, made in the same script as a
/// phase advance (all of them with it, or none). The key must be a
/// [`RedisStore::business_key`](crate::RedisStore::business_key) of the
/// record's account.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisWrite {
    /// The key written.
    pub key: String,
    /// What is done to it.
    pub op: WriteOp,
    /// The hash field (`HSet` only; empty otherwise).
    pub field: Vec<u8>,
    /// The value (the increment for `IncrBy`; empty for `Del`).
    pub value: Vec<u8>,
}

impl RedisWrite {
    fn new(key: String, op: WriteOp, field: &[u8], value: &[u8]) -> Self {
        Self {
            key,
            op,
            field: field.to_vec(),
            value: value.to_vec(),
        }
    }

    /// `SET key value`.
    pub fn set(key: String, value: impl AsRef<[u8]>) -> Self {
        Self::new(key, WriteOp::Set, b"", value.as_ref())
    }

    /// `HSET key field value`.
    pub fn hset(key: String, field: impl AsRef<[u8]>, value: impl AsRef<[u8]>) -> Self {
        Self::new(key, WriteOp::HSet, field.as_ref(), value.as_ref())
    }

    /// `INCRBY key by`.
    pub fn incr_by(key: String, by: i64) -> Self {
        Self::new(key, WriteOp::IncrBy, b"", by.to_string().as_bytes())
    }

    /// `SADD key member`.
    pub fn sadd(key: String, member: impl AsRef<[u8]>) -> Self {
        Self::new(key, WriteOp::SAdd, b"", member.as_ref())
    }

    /// `DEL key`.
    pub fn del(key: String) -> Self {
        Self::new(key, WriteOp::Del, b"", b"")
    }
}
