//! A Hugging Face tokenizer (`tokenizer.json`) with the special tokens of `tokenizer_config.json`.

use std::path::{Path, PathBuf};

use crate::{Result, TrainError};

/// A tokenizer with the special-token ids training needs and the files a checkpoint copies.
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    /// `eos_token` of `tokenizer_config.json` (required): ends plain completions and sampled rows.
    pub eos_id: u32,
    /// `pad_token`, or EOS when there is none; fills padded positions.
    pub pad_id: u32,
    /// What text outside the vocabulary becomes (none for byte-level BPE, which has no such text).
    pub unk_id: Option<u32>,
    /// The files to copy into checkpoints.
    pub files: Vec<PathBuf>,
    /// The chat template, when the model has one.
    pub chat: Option<crate::chat::ChatTemplate>,
    /// The longest vocabulary entry in bytes: no token covers more of a text (byte-level BPE's and
    /// SentencePiece's entries spell their bytes in at least as many).
    max_token_bytes: usize,
}

/// Which end of a text a caller keeps when it has more tokens than it can use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Keep {
    /// The first tokens (a completion, SFT's and DPO's truncation).
    Start,
    /// The last tokens (a GRPO prompt, as TRL keeps a prompt's end).
    End,
}

fn token_name(v: &serde_json::Value) -> Option<String> {
    match v {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content").and_then(|c| c.as_str()).map(String::from),
        _ => None,
    }
}

impl TextTokenizer {
    /// Loads `tokenizer.json` (required) and `tokenizer_config.json` (optional) from `dir`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        let inner = tokenizers::Tokenizer::from_file(&path).map_err(|e| {
            TrainError::Tokenizer(format!("cannot load tokenizer {}: {e}", path.display()))
        })?;
        let config_path = dir.join("tokenizer_config.json");
        let config: serde_json::Value = match std::fs::read_to_string(&config_path) {
            Ok(text) => serde_json::from_str(&text).map_err(|e| {
                TrainError::Tokenizer(format!("{}: not valid JSON: {e}", config_path.display()))
            })?,
            Err(_) => serde_json::Value::Null,
        };
        let id_of = |key: &str| -> Option<u32> {
            config
                .get(key)
                .and_then(token_name)
                .and_then(|t| inner.token_to_id(&t))
        };
        let eos_id = id_of("eos_token").ok_or_else(|| {
            TrainError::Tokenizer(format!(
                "{}: no eos_token that the tokenizer knows; it is needed to end completions",
                config_path.display()
            ))
        })?;
        let pad_id = id_of("pad_token").unwrap_or(eos_id);
        let unk_id = unknown_token(&inner).and_then(|t| inner.token_to_id(&t));
        let chat = crate::chat::ChatTemplate::from_dir(dir, &config)?;
        let mut files = vec![path];
        for name in [
            "tokenizer_config.json",
            "special_tokens_map.json",
            "generation_config.json",
        ] {
            if dir.join(name).exists() {
                files.push(dir.join(name));
            }
        }
        let max_token_bytes = inner
            .get_vocab(true)
            .keys()
            .map(String::len)
            .max()
            .unwrap_or(1)
            .max(4);
        Ok(Self {
            inner,
            eos_id,
            pad_id,
            unk_id,
            files,
            chat,
            max_token_bytes,
        })
    }

    /// Token ids of `text` for a caller that uses `max_tokens` of them at most, from the `keep` end.
    /// A text longer than twice the bytes `max_tokens` tokens can cover is cut to that at the kept
    /// end first, so a huge row costs memory in proportion to `--max-length`, not to its size (the
    /// tokenizer holds hundreds of bytes per character). The ids still number more than
    /// `max_tokens` (the caller truncates or skips as before), and the kept ones are the whole
    /// text's: they end within the first half of the window, the cut is in the second.
    pub fn encode_at_most(&self, text: &str, max_tokens: usize, keep: Keep) -> Result<Vec<u32>> {
        let window = max_tokens
            .saturating_mul(self.max_token_bytes)
            .saturating_mul(2);
        if text.len() <= window {
            return self.encode(text);
        }
        let part = match keep {
            Keep::Start => {
                let end = (0..=window).rev().find(|&i| text.is_char_boundary(i));
                &text[..end.unwrap_or(0)]
            }
            Keep::End => {
                let start = (text.len() - window..=text.len()).find(|&i| text.is_char_boundary(i));
                &text[start.unwrap_or(text.len())..]
            }
        };
        self.encode(part)
    }

    /// Token ids of `text`, without special tokens added.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self
            .inner
            .encode(text, false)
            .map_err(|e| TrainError::Tokenizer(format!("tokenizer: {e}")))?
            .get_ids()
            .to_vec())
    }

    /// The text of `ids`, special tokens skipped.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, true)
            .map_err(|e| TrainError::Tokenizer(format!("tokenizer: {e}")))
    }

    /// The chat template, or an error saying conversational data needs one.
    pub fn chat_template(&self) -> Result<&crate::chat::ChatTemplate> {
        self.chat.as_ref().ok_or_else(|| {
            TrainError::Tokenizer(
                "conversational data (messages) needs a chat template, and this tokenizer has none \
                 (no chat_template in tokenizer_config.json, no chat_template.jinja)"
                    .into(),
            )
        })
    }

    /// Tokens in the vocabulary, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Whether `other` maps every token to the same id.
    pub fn same_vocabulary(&self, other: &TextTokenizer) -> bool {
        self.inner.get_vocab(true) == other.inner.get_vocab(true)
    }

    /// Whether `ids` hold the unknown token (text the vocabulary cannot spell).
    pub fn has_unknown(&self, ids: &[u32]) -> bool {
        self.unk_id.is_some_and(|unk| ids.contains(&unk))
    }
}

/// The unknown token of the tokenizer's model, where it has one.
fn unknown_token(tokenizer: &tokenizers::Tokenizer) -> Option<String> {
    use tokenizers::models::ModelWrapper;
    match tokenizer.get_model() {
        ModelWrapper::BPE(m) => m.unk_token.clone(),
        ModelWrapper::WordPiece(m) => Some(m.unk_token.clone()),
        ModelWrapper::WordLevel(m) => Some(m.unk_token.clone()),
        // Unigram keeps its unknown id private; its byte fallback rarely needs one.
        ModelWrapper::Unigram(_) => None,
    }
}
