//! # idemkit-labels
//!
//! The reference service built on idemkit:
//!
//! - [`service`]: the shipping-label API (`idemkit serve`), which implements its
//!   published contract with idemkit's phases (the courier call cannot be rolled
//!   back) and calls the courier through idemkit's client;
//! - [`proto`]: the same API over gRPC (`labels.v1.Labels`: `CreateLabel`,
//!   `GetLabel`, `GetTracking`), served by `idemkit serve` beside REST, with
//!   its generated client and the proto3 JSON mapping that ties the two;
//! - [`contract`]: the integrator contract generated from the running configuration
//!   (`idemkit-contract` with the labels service's examples and gRPC section);
//! - [`courier`]: the courier simulator (`idemkit courier`), a separate HTTP service
//!   that honours `Idempotency-Key` itself and injects faults on request, so tests
//!   count real external effects.

pub mod contract;
pub mod courier;
pub mod proto;
pub mod service;
