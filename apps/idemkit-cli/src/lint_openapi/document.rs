//! Reading an API description: OpenAPI 3.0 / 3.1 or Swagger 2.0, JSON or YAML, from a
//! file, standard input or an `http://` URL, and following its local `$ref`s.

use anyhow::{Context, bail};
use serde_json::Value;

/// A parsed description and what it is.
#[derive(Debug)]
pub struct Document {
    root: Value,
    kind: String,
}

/// How many `$ref` hops a lookup follows before calling it a cycle.
const MAX_HOPS: usize = 64;

impl Document {
    /// Checks that `root` is an OpenAPI 3.x or Swagger 2.0 document.
    pub fn new(root: Value) -> anyhow::Result<Self> {
        let kind = if let Some(v) = root.get("openapi").and_then(Value::as_str) {
            if !v.starts_with("3.") {
                bail!("OpenAPI version {v} is not supported (3.0 and 3.1 are, and Swagger 2.0)");
            }
            format!("OpenAPI {v}")
        } else if let Some(v) = root.get("swagger").and_then(Value::as_str) {
            if v != "2.0" {
                bail!("Swagger version {v} is not supported (2.0 is)");
            }
            "Swagger 2.0".to_owned()
        } else if root.is_object() {
            bail!("neither an `openapi` nor a `swagger` member: not an OpenAPI document");
        } else {
            bail!("the document is not a JSON or YAML object");
        };
        if let Some(paths) = root.get("paths")
            && !paths.is_object()
        {
            bail!("`paths` is not an object");
        }
        Ok(Self { root, kind })
    }

    /// Parses JSON, or YAML when the text is not JSON.
    pub fn parse(text: &str) -> anyhow::Result<Self> {
        let text = text.trim_start_matches('\u{feff}');
        let root: Value = if text.trim_start().starts_with('{') {
            serde_json::from_str(text).context("parsing JSON")?
        } else {
            yaml_serde::from_str(text).context("parsing YAML")?
        };
        Self::new(root)
    }

    /// Reads `source`: `-` for standard input, an `http://` URL, or a file path.
    pub fn load(source: &str) -> anyhow::Result<Self> {
        let text = if source == "-" {
            std::io::read_to_string(std::io::stdin()).context("reading standard input")?
        } else if source.starts_with("http://") || source.starts_with("https://") {
            fetch(source)?
        } else {
            std::fs::read_to_string(source).with_context(|| format!("reading {source}"))?
        };
        Self::parse(&text).with_context(|| format!("reading {source}"))
    }

    /// The whole document.
    pub fn root(&self) -> &Value {
        &self.root
    }

    /// `OpenAPI 3.1.0`, `Swagger 2.0`.
    pub fn kind(&self) -> &str {
        &self.kind
    }

    /// `v` with its `$ref`s followed. A reference that leaves the document, or that
    /// points nowhere, is noted in `notes` and `v` itself is returned.
    pub fn deref<'a>(&'a self, mut v: &'a Value, notes: &mut Vec<String>) -> &'a Value {
        for _ in 0..MAX_HOPS {
            let Some(reference) = v.get("$ref").and_then(Value::as_str) else {
                return v;
            };
            let Some(fragment) = reference.strip_prefix('#') else {
                notes.push(format!("`$ref: {reference}` leaves the document: not followed"));
                return v;
            };
            let pointer = percent_encoding::percent_decode_str(fragment).decode_utf8_lossy();
            match self.root.pointer(&pointer) {
                Some(next) => v = next,
                None => {
                    notes.push(format!("`$ref: {reference}` points nowhere"));
                    return v;
                }
            }
        }
        notes.push(format!("`$ref` chain longer than {MAX_HOPS} (a cycle?)"));
        v
    }
}

/// `GET url` (plain http: the binary carries no TLS stack).
fn fetch(url: &str) -> anyhow::Result<String> {
    if url.starts_with("https://") {
        bail!(
            "{url}: https is not supported (the binary carries no TLS stack); download the document and pass the file"
        );
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async {
        let client = reqwest::Client::builder()
            .timeout(std::time::Duration::from_secs(30))
            .no_proxy()
            .build()?;
        let res = client
            .get(url)
            .header("accept", "application/json, application/yaml;q=0.9, */*;q=0.1")
            .send()
            .await
            .with_context(|| format!("fetching {url}"))?;
        let status = res.status();
        if !status.is_success() {
            bail!("fetching {url}: the server answered {status}");
        }
        res.text().await.with_context(|| format!("reading {url}"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yaml_with_numeric_response_codes_reads_like_json() {
        let doc = Document::parse(
            "openapi: 3.0.3\ninfo: {title: t, version: '1'}\npaths:\n  /x:\n    post:\n      responses:\n        201: {description: ok}\n",
        )
        .unwrap();
        assert_eq!(doc.kind(), "OpenAPI 3.0.3");
        assert!(doc.root().pointer("/paths/~1x/post/responses/201").is_some());
    }

    #[test]
    fn refs_are_followed_percent_decoded_and_remote_ones_noted() {
        let doc = Document::new(serde_json::json!({
            "openapi": "3.1.0",
            "components": {"schemas": {"a b": {"$ref": "#/components/schemas/c"}, "c": {"type": "object"}}},
            "x": {"$ref": "#/components/schemas/a%20b"}, "y": {"$ref": "other.yaml#/c"}, "z": {"$ref": "#/nowhere"},
            "loop": {"$ref": "#/loop"}
        }))
        .unwrap();
        let mut notes = Vec::new();
        let root = doc.root();
        assert_eq!(doc.deref(&root["x"], &mut notes)["type"], "object");
        assert!(notes.is_empty());
        doc.deref(&root["y"], &mut notes);
        doc.deref(&root["z"], &mut notes);
        doc.deref(&root["loop"], &mut notes);
        assert_eq!(notes.len(), 3, "{notes:?}");
        assert!(notes[0].contains("leaves the document"));
    }

    #[test]
    fn unreadable_documents_are_errors() {
        assert!(Document::parse("{").is_err());
        assert!(Document::parse("{\"openapi\": \"2.5\"}").is_err());
        assert!(Document::parse("just: yaml").is_err());
        assert!(Document::parse("- a\n- b").is_err());
    }
}
