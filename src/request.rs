//! STUB (replaced by the hash branch): OpenAI request parsing.
use std::borrow::Cow;
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApiKind { Completions, ChatCompletions }
#[derive(Debug)]
pub struct InferenceRequest<'a> {
    pub model: Cow<'a, str>,
    pub max_tokens: Option<u32>,
    pub stream: bool,
    pub include_usage: bool,
    pub cache_salt: Option<Cow<'a, str>>,
    pub skipped_parts: u32,
    pub text: Cow<'a, str>,
}
#[derive(Debug)]
pub enum ParseError { InvalidJson(String) }
impl core::fmt::Display for ParseError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result { write!(f, "{self:?}") }
}
pub fn parse(_kind: ApiKind, body: &[u8]) -> Result<InferenceRequest<'_>, ParseError> {
    let s = core::str::from_utf8(body).map_err(|e| ParseError::InvalidJson(e.to_string()))?;
    Ok(InferenceRequest { model: "m".into(), max_tokens: None, stream: false, include_usage: false, cache_salt: None, skipped_parts: 0, text: s.into() })
}
