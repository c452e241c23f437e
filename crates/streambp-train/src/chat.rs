//! Chat templates from `tokenizer_config.json` (or `chat_template.jinja`), rendered as transformers'
//! `apply_chat_template` does: `messages`, `add_generation_prompt`, `bos_token`, `eos_token`, and
//! `raise_exception`.

use std::path::Path;

use minijinja::{Environment, Error, ErrorKind, Value};

use crate::{Result, TrainError};

/// A compiled chat template with the special tokens it may print.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

fn raise_exception(message: String) -> std::result::Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

impl ChatTemplate {
    /// Compiles the Jinja `source` as transformers does (trim_blocks, lstrip_blocks, Python string
    /// methods); errors when it does not parse.
    pub fn new(source: String, bos_token: String, eos_token: String) -> Result<Self> {
        let mut env = Environment::new();
        // transformers compiles templates with trim_blocks and lstrip_blocks.
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| TrainError::Tokenizer(e.to_string()))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned("chat", source)
            .map_err(|e| TrainError::Tokenizer(format!("chat template does not parse: {e}")))?;
        Ok(Self {
            env,
            bos_token,
            eos_token,
        })
    }

    /// The template of a model directory: `chat_template.jinja`, else `chat_template` in the config
    /// (a string, or a list of named templates of which `default` is used).
    pub fn from_dir(dir: &Path, config: &serde_json::Value) -> Result<Option<Self>> {
        let token = |key: &str| match config.get(key) {
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(serde_json::Value::Object(o)) => o
                .get("content")
                .and_then(|c| c.as_str())
                .unwrap_or_default()
                .to_string(),
            _ => String::new(),
        };
        let file = dir.join("chat_template.jinja");
        let source = if file.exists() {
            Some(std::fs::read_to_string(&file).map_err(TrainError::io("read", &file))?)
        } else {
            match config.get("chat_template") {
                Some(serde_json::Value::String(s)) => Some(s.clone()),
                Some(serde_json::Value::Array(list)) => list
                    .iter()
                    .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                    .and_then(|t| t.get("template"))
                    .and_then(|t| t.as_str())
                    .map(String::from),
                _ => None,
            }
        };
        source
            .map(|s| Self::new(s, token("bos_token"), token("eos_token")))
            .transpose()
    }

    /// The conversation `messages` (a JSON array of `{role, content}`) as text.
    pub fn render(
        &self,
        messages: &serde_json::Value,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let template = self
            .env
            .get_template("chat")
            .map_err(|e| TrainError::Tokenizer(e.to_string()))?;
        template
            .render(minijinja::context! {
                messages => Value::from(minijinja::value::Serde(messages)),
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token.clone(),
                eos_token => self.eos_token.clone(),
            })
            .map_err(|e| TrainError::Tokenizer(format!("chat template: {e}")))
    }

    /// `(prompt, completion)` texts of a conversation split before its reply: the prompt rendered with
    /// the generation prompt, the completion what the whole conversation adds after it.
    pub fn split(
        &self,
        prompt: &[serde_json::Value],
        reply: &[serde_json::Value],
    ) -> Result<(String, String)> {
        let prompt_text = self.render(&serde_json::Value::from(prompt.to_vec()), true)?;
        let all: Vec<serde_json::Value> = prompt.iter().chain(reply).cloned().collect();
        let full = self.render(&serde_json::Value::from(all), false)?;
        match full.strip_prefix(&prompt_text) {
            Some(completion) => Ok((prompt_text, completion.to_string())),
            None => Err(TrainError::Tokenizer(
                "the chat template renders the prompt differently inside the full conversation; \
                 cannot tell the reply's tokens apart"
                    .into(),
            )),
        }
    }

    /// The conversation `messages` as text segments, each marked `true` where it is an assistant turn
    /// (what the assistant-only loss trains on). Turn `i` starts where the conversation before it,
    /// rendered with the generation prompt, ends, and ends where the conversation through it ends.
    /// Templates that render an earlier turn differently once later turns follow (Qwen3's thinking
    /// blocks) cannot be cut this way; then `None`.
    pub fn assistant_segments(
        &self,
        messages: &[serde_json::Value],
    ) -> Result<Option<Vec<(String, bool)>>> {
        let render = |upto: usize, generation: bool| {
            self.render(
                &serde_json::Value::from(messages[..upto].to_vec()),
                generation,
            )
        };
        let full = render(messages.len(), false)?;
        let mut segments = Vec::new();
        let mut done = 0;
        for (i, message) in messages.iter().enumerate() {
            if message.get("role").and_then(|r| r.as_str()) != Some("assistant") {
                continue;
            }
            // A template may refuse a prefix (say, one that starts with the assistant): then the turns
            // cannot be cut this way either.
            let (Ok(start), Ok(end)) = (render(i, true), render(i + 1, false)) else {
                return Ok(None);
            };
            let consistent = start.len() >= done
                && end.len() >= start.len()
                && full.starts_with(&start)
                && full.starts_with(&end);
            if !consistent {
                return Ok(None);
            }
            segments.push((full[done..start.len()].to_string(), false));
            segments.push((full[start.len()..end.len()].to_string(), true));
            done = end.len();
        }
        if done < full.len() {
            segments.push((full[done..].to_string(), false));
        }
        Ok(Some(segments))
    }
}
