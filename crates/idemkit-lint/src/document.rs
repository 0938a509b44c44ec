//! Reading an API description: OpenAPI 3.0 / 3.1 or Swagger 2.0, JSON or YAML, from
//! its text (the caller reads the file, standard input or URL), and following its
//! local `$ref`s.

use serde_json::Value;

/// Why a text is not a document the linter reads.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DocumentError {
    /// The text is neither JSON nor YAML.
    #[error("parsing {format}: {message}")]
    Syntax {
        /// `JSON` or `YAML`: what the text looked like.
        format: &'static str,
        /// The parser's message.
        message: String,
    },
    /// The document is JSON or YAML, but not an OpenAPI 3.x or Swagger 2.0 document.
    #[error("{0}")]
    NotOpenApi(String),
}

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
    pub fn new(root: Value) -> Result<Self, DocumentError> {
        let refuse = |why: String| Err(DocumentError::NotOpenApi(why));
        let kind = if let Some(v) = root.get("openapi").and_then(Value::as_str) {
            if !v.starts_with("3.") {
                return refuse(format!(
                    "OpenAPI version {v} is not supported (3.0 and 3.1 are, and Swagger 2.0)"
                ));
            }
            format!("OpenAPI {v}")
        } else if let Some(v) = root.get("swagger").and_then(Value::as_str) {
            if v != "2.0" {
                return refuse(format!("Swagger version {v} is not supported (2.0 is)"));
            }
            "Swagger 2.0".to_owned()
        } else if root.is_object() {
            return refuse("neither an `openapi` nor a `swagger` member: not an OpenAPI document".into());
        } else {
            return refuse("the document is not a JSON or YAML object".into());
        };
        if let Some(paths) = root.get("paths")
            && !paths.is_object()
        {
            return refuse("`paths` is not an object".into());
        }
        Ok(Self { root, kind })
    }

    /// Parses JSON, or YAML when the text is not JSON.
    pub fn parse(text: &str) -> Result<Self, DocumentError> {
        let text = text.trim_start_matches('\u{feff}');
        let root: Value = if text.trim_start().starts_with('{') {
            serde_json::from_str(text).map_err(|e| DocumentError::Syntax {
                format: "JSON",
                message: e.to_string(),
            })?
        } else {
            yaml_serde::from_str(text).map_err(|e| DocumentError::Syntax {
                format: "YAML",
                message: e.to_string(),
            })?
        };
        Self::new(root)
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
