//! [`CheckConfig`]: what a check sends, which gates it runs, and how it
//! judges them.

use super::*;

/// Everything a check needs besides the transport.
#[derive(Debug, Clone)]
pub struct CheckConfig {
    pub(super) template: Template,
    pub(super) gates: Vec<Gate>,
    pub(super) concurrency: usize,
    pub(super) replay_status: Option<u16>,
    pub(super) replay_marker: (HeaderName, String),
    pub(super) same_headers: Vec<HeaderName>,
    pub(super) other_account: Option<(HeaderName, HeaderValue)>,
    pub(super) count_url: Option<String>,
    pub(super) count_pointer: Option<String>,
    pub(super) id_pointer: Option<String>,
    pub(super) state_url: Option<String>,
    pub(super) volatile: Vec<String>,
    pub(super) published: Option<Published>,
    pub(super) uuid_keys: bool,
}

impl CheckConfig {
    /// The seven keyed gates ([`Gate::KEYED`]) against `template`, 50 at once, replay marker
    /// `Idempotent-Replayed: true`, no probe, no second account.
    pub fn new(template: Template) -> Self {
        Self {
            template,
            gates: Gate::KEYED.to_vec(),
            concurrency: DEFAULT_CONCURRENCY,
            replay_status: None,
            replay_marker: (HeaderName::from_static("idempotent-replayed"), "true".into()),
            same_headers: vec![
                HeaderName::from_static("content-type"),
                HeaderName::from_static("location"),
            ],
            other_account: None,
            count_url: None,
            count_pointer: None,
            id_pointer: None,
            state_url: None,
            volatile: Vec::new(),
            published: None,
            uuid_keys: false,
        }
    }

    /// Runs only these gates (always in the documented order, duplicates dropped).
    pub fn with_gates(mut self, gates: impl IntoIterator<Item = Gate>) -> Self {
        let mut gates: Vec<Gate> = gates.into_iter().collect();
        gates.sort();
        gates.dedup();
        self.gates = gates;
        self
    }

    /// How many identical requests the concurrency and in-progress gates start at once
    /// (at least 2).
    pub fn with_concurrency(mut self, n: usize) -> Self {
        self.concurrency = n.max(2);
        self
    }

    /// The status replays answer when it differs from the original's (e.g. 200 for a
    /// replayed 201).
    pub fn with_replay_status(mut self, status: u16) -> Self {
        self.replay_status = Some(status);
        self
    }

    /// The header (and value, compared case-insensitively) that marks a replay.
    pub fn with_replay_marker(mut self, name: HeaderName, value: impl Into<String>) -> Self {
        self.replay_marker = (name, value.into());
        self
    }

    /// One more header a replay must repeat exactly (`content-type` and `location`
    /// always are).
    pub fn with_same_header(mut self, name: HeaderName) -> Self {
        if !self.same_headers.contains(&name) {
            self.same_headers.push(name);
        }
        self
    }

    /// A second account's credentials: this header replaces the template's header of
    /// the same name for the isolation gate.
    pub fn with_other_account(mut self, name: HeaderName, value: HeaderValue) -> Self {
        self.other_account = Some((name, value));
        self
    }

    /// The side-effect probe: a URL fetched (`GET`, with the template's headers) that
    /// answers the caller's effect count as `{"count": n}` or a bare number.
    pub fn with_count_url(mut self, url: impl Into<String>) -> Self {
        self.count_url = Some(url.into());
        self
    }

    /// Where the count probe's answer holds the count (e.g. `/shipments` in
    /// `{"shipments": 3, …}`), instead of `{"count": n}` or a bare number.
    pub fn with_count_pointer(mut self, pointer: impl Into<String>) -> Self {
        self.count_pointer = Some(pointer.into());
        self
    }

    /// A JSON pointer to the resource id in successful answers, used to tell effects
    /// apart by what the answers show.
    pub fn with_id_pointer(mut self, pointer: impl Into<String>) -> Self {
        self.id_pointer = Some(pointer.into());
        self
    }

    /// The state probe of the claimed-idempotency gate: a URL fetched (`GET`, with the
    /// template's headers) whose JSON is compared before and after a repeated request.
    pub fn with_state_url(mut self, url: impl Into<String>) -> Self {
        self.state_url = Some(url.into());
        self
    }

    /// A JSON pointer to a member the state probe's JSON may change on its own
    /// (a timestamp, a version), removed before comparing; `*` matches every
    /// element or member (`/items/*/updatedAt`).
    pub fn with_volatile(mut self, pointer: impl Into<String>) -> Self {
        self.volatile.push(pointer.into());
        self
    }

    /// What the endpoint publishes, for the policy gate.
    pub fn with_published(mut self, published: Published) -> Self {
        self.published = Some(published);
        self
    }

    /// Every valid key the gates send is a bare UUID4 (`7c9e6679-7425-40de-944b-e07fc1f90ae7`),
    /// as an AIP-155 `request_id` must be, instead of `idemkit-check-<gate>-<uuid>`.
    pub fn with_uuid4_keys(mut self) -> Self {
        self.uuid_keys = true;
        self
    }

    /// The published policy, if one was given.
    pub fn published(&self) -> Option<&Published> {
        self.published.as_ref()
    }

    /// The template.
    pub fn template(&self) -> &Template {
        &self.template
    }

    /// The gates that will run, in order.
    pub fn gates(&self) -> &[Gate] {
        &self.gates
    }

    /// The burst size.
    pub fn concurrency(&self) -> usize {
        self.concurrency
    }
}
