//! Errors: those a request gets (OpenAI's error body with an HTTP status) and those of the
//! server itself.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use keydiff::{EngineError, ModelError};

/// A request's error, sent as `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    pub status: StatusCode,
    /// OpenAI's error type: `invalid_request_error`, `server_error`, ….
    pub kind: &'static str,
    pub message: String,
    /// The request field at fault, when one is.
    pub param: Option<&'static str>,
}

impl ApiError {
    /// 400: the request is malformed or asks for something this server does not do.
    pub fn invalid(message: impl Into<String>, param: Option<&'static str>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message: message.into(),
            param,
        }
    }

    /// 500: the server failed.
    pub fn internal(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "server_error",
            message: message.into(),
            param: None,
        }
    }

    /// 503: the server cannot take the request now.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            kind: "server_error",
            message: message.into(),
            param: None,
        }
    }

    /// The JSON error object (inside `{"error": …}`).
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.status.as_u16(),
        })
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        let message = e.to_string();
        match e {
            EngineError::EmptyPrompt
            | EngineError::PromptTooLong { .. }
            | EngineError::PromptTextTooLong { .. } => Self::invalid(message, Some("prompt")),
            // A template that rejects the messages (e.g. roles that do not alternate).
            EngineError::NoChatTemplate | EngineError::Model(ModelError::ChatTemplate(_)) => {
                Self::invalid(message, Some("messages"))
            }
            EngineError::BadField { field, .. } => Self::invalid(message, Some(field)),
            EngineError::BadParams(_) | EngineError::Tokenizer(_) => Self::invalid(message, None),
            // A slot file to restore that is missing, damaged or made otherwise.
            EngineError::CacheFile { .. } => Self::invalid(message, Some("filename")),
            // The request's KV cache does not fit in the memory there is now.
            EngineError::OutOfMemory(_) => Self::unavailable(message),
            // The device ran out of memory beyond the plan (another process, a temporary):
            // the request may fit later.
            _ if message.contains("CUDA_ERROR_OUT_OF_MEMORY") => {
                Self::unavailable(with_hint(message))
            }
            _ => Self::internal(with_hint(message)),
        }
    }
}

/// `message`, with what to do about a CUDA failure a user can fix
/// ([`keydiff::cuda_error_hint`]).
fn with_hint(message: String) -> String {
    match keydiff::cuda_error_hint(&message) {
        Some(hint) => format!("{message} (hint: {hint})"),
        None => message,
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = axum::Json(serde_json::json!({ "error": self.body() }));
        (self.status, body).into_response()
    }
}

/// What can stop the server itself. A message has the I/O error's own; it is not also the
/// [`std::error::Error::source`], which a printer of the chain (anyhow's `{:#}`) would print a
/// second time.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("cannot listen on {addr}: {error}")]
    Bind { addr: String, error: std::io::Error },
    #[error("server I/O: {0}")]
    Io(std::io::Error),
    #[error("the generation worker panicked")]
    Worker,
    /// [`crate::Server::run`] called inside an async runtime, which it cannot block.
    #[error("Server::run blocks its thread and cannot run inside an async runtime: await Server::serve there")]
    InRuntime,
}

impl From<std::io::Error> for ServerError {
    fn from(e: std::io::Error) -> Self {
        Self::Io(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the client got wrong is a 400 naming the field; what the server lacks, 503;
    /// the rest, 500.
    #[test]
    fn engine_errors_get_the_status_of_whose_fault_they_are() {
        let cases = [
            (EngineError::EmptyPrompt, 400, Some("prompt")),
            (
                EngineError::PromptTooLong {
                    tokens: 9,
                    context: 8,
                    limited: false,
                },
                400,
                Some("prompt"),
            ),
            (EngineError::NoChatTemplate, 400, Some("messages")),
            (
                EngineError::Model(ModelError::ChatTemplate(
                    "Conversation roles must alternate".into(),
                )),
                400,
                Some("messages"),
            ),
            (EngineError::BadParams("top-p".into()), 400, None),
            (EngineError::OutOfMemory("KV".into()), 503, None),
            (
                EngineError::CacheFile {
                    path: "a.kv".into(),
                    reason: "no such file".into(),
                },
                400,
                Some("filename"),
            ),
            (EngineError::Hub("offline".into()), 500, None),
        ];
        for (e, status, param) in cases {
            let what = e.to_string();
            let a = ApiError::from(e);
            assert_eq!(a.status.as_u16(), status, "{what}");
            assert_eq!(a.param, param, "{what}");
            assert_eq!(a.message, what);
        }
        // A device out of memory mid-request may pass: 503, with the hint.
        let oom = EngineError::Model(ModelError::Unsupported(
            "DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")".into(),
        ));
        let a = ApiError::from(oom);
        assert_eq!(a.status.as_u16(), 503);
        assert!(
            a.message.contains("(hint: the GPU ran out of memory"),
            "{}",
            a.message
        );
    }
}
