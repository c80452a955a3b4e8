//! The terms of the LLM APIs whose responses report their token usage:
//! input and output tokens, one unit each, from a plain body or from the
//! events of a stream.

use super::meter::Term;
use super::path::Path;

/// An API whose responses report their token usage.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preset {
    /// OpenAI chat completions: `usage.prompt_tokens` and
    /// `usage.completion_tokens`, in the body or in a stream's last chunk
    /// (the chunks before it have `"usage": null`).
    OpenAiChat,
    /// OpenAI Responses: `usage.input_tokens` and `usage.output_tokens` in
    /// the body, or under `response` in the stream's `response.completed`
    /// event.
    OpenAiResponses,
    /// Anthropic Messages: `usage.input_tokens` and `usage.output_tokens`
    /// in the body; in a stream, under `message` in `message_start`, then
    /// cumulative at the top of each `message_delta` (the last one wins).
    AnthropicMessages,
}

impl Preset {
    /// The preset's terms: every one must be found.
    pub fn terms(self) -> Vec<Term> {
        let (input, output): (&[&str], &[&str]) = match self {
            Preset::OpenAiChat => (&["/usage/prompt_tokens"], &["/usage/completion_tokens"]),
            Preset::OpenAiResponses => (
                &["/usage/input_tokens", "/response/usage/input_tokens"],
                &["/usage/output_tokens", "/response/usage/output_tokens"],
            ),
            Preset::AnthropicMessages => (
                &["/usage/input_tokens", "/message/usage/input_tokens"],
                &["/usage/output_tokens", "/message/usage/output_tokens"],
            ),
        };
        [input, output].into_iter().map(term).collect()
    }
}

/// One unit per token at the first of `pointers` a document has.
fn term(pointers: &[&str]) -> Term {
    Term {
        // The pointers are the constants above, each valid.
        any_of: pointers
            .iter()
            .filter_map(|p| Path::parse(p).ok())
            .collect(),
        weight: 1,
    }
}
