//! TRL-style rows for SFT: `messages` (loss on the assistant turns), `prompt` + `completion` (loss on
//! the completion only) or `text` (loss on every token), from any [`DataSource`]. A malformed row is
//! an error naming its file and line or row; sequences over the length limit are truncated or skipped,
//! and the log says how many.

use streambp_objectives::IGNORE_INDEX;

use crate::dataset::DataSource;
use crate::token_store::ExampleSink;
use crate::tokenizer::{Keep, TextTokenizer};
use crate::{Result, TrainError};

/// One tokenized training example: ids, HF-aligned labels ([`IGNORE_INDEX`] where there is no loss), and each
/// token's position in its document (`0..n` for one document; restarting at 0 in a packed example).
#[derive(Debug, Clone, PartialEq)]
pub struct Example {
    /// The token ids.
    pub input_ids: Vec<u32>,
    /// One per token, aligned with `input_ids` (shifted by the objective).
    pub labels: Vec<i64>,
    /// One per token: its position inside its document.
    pub position_ids: Vec<u32>,
}

impl crate::checkpoint::Digest for Example {
    fn digest(&self, into: &mut crate::checkpoint::Fingerprint) {
        into.numbers(self.input_ids.iter().map(|&t| i64::from(t)));
        into.numbers(self.labels.iter().copied());
        into.numbers(self.position_ids.iter().map(|&p| i64::from(p)));
    }
}

impl Example {
    /// One document.
    pub fn new(input_ids: Vec<u32>, labels: Vec<i64>) -> Self {
        let position_ids = (0..input_ids.len() as u32).collect();
        Self {
            input_ids,
            labels,
            position_ids,
        }
    }

    /// A prompt and its completion, with the loss on the completion only.
    pub fn from_pair(prompt: Vec<u32>, completion: Vec<u32>) -> Self {
        let mut labels: Vec<i64> = vec![IGNORE_INDEX; prompt.len()];
        labels.extend(completion.iter().map(|&t| t as i64));
        let mut ids = prompt;
        ids.extend(completion);
        Self::new(ids, labels)
    }

    /// Keeps the first `n` tokens.
    pub fn truncate(&mut self, n: usize) {
        self.input_ids.truncate(n);
        self.labels.truncate(n);
        self.position_ids.truncate(n);
    }

    /// Documents side by side in one row ([`pack`]): positions restart at each, and each one's first
    /// token is no target (nothing before it in its document predicts it).
    pub fn join(documents: impl Iterator<Item = Example>) -> Example {
        let mut row = Example::new(Vec::new(), Vec::new());
        for e in documents {
            row.input_ids.extend(&e.input_ids);
            row.labels.push(IGNORE_INDEX);
            row.labels.extend(&e.labels[1.min(e.labels.len())..]);
            row.position_ids.extend(e.position_ids);
        }
        row
    }

    /// Tokens with a loss (the first token is never predicted).
    pub fn targets(&self) -> usize {
        self.labels
            .iter()
            .skip(1)
            .filter(|&&l| l != IGNORE_INDEX)
            .count()
    }
}

/// Packs whole examples into rows of at most `max_length` tokens, best-fit decreasing (TRL's `bfd`):
/// the longest first, each into the fullest row it still fits. Positions restart at each example and
/// its first token is no target, so a packed row trains exactly as its examples would apart, with less
/// padding. Deterministic: ties keep the input order.
pub fn pack(examples: Vec<Example>, max_length: usize) -> Vec<Example> {
    let lengths: Vec<usize> = examples.iter().map(|e| e.input_ids.len()).collect();
    let mut examples: Vec<Option<Example>> = examples.into_iter().map(Some).collect();
    pack_plan(&lengths, max_length)
        .into_iter()
        .map(|members| Example::join(members.into_iter().filter_map(|i| examples[i].take())))
        .collect()
}

/// [`pack`]'s rows from the examples' lengths alone: each row's example indices, in order (empty
/// examples left out).
pub fn pack_plan(lengths: &[usize], max_length: usize) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..lengths.len()).filter(|&i| lengths[i] > 0).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(lengths[i]));
    let mut rows: Vec<Vec<usize>> = Vec::new();
    // (room left, row) of every row, to find the fullest row that still fits in O(log rows).
    let mut room: std::collections::BTreeSet<(usize, usize)> = Default::default();
    for i in order {
        let len = lengths[i];
        match room.range((len, 0)..).next().copied() {
            Some((left, row)) => {
                room.remove(&(left, row));
                room.insert((left - len, row));
                rows[row].push(i);
            }
            None => {
                room.insert((max_length.saturating_sub(len), rows.len()));
                rows.push(vec![i]);
            }
        }
    }
    rows
}

/// What to do with examples longer than the limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Overflow {
    /// Keep the first `max_length` tokens.
    Truncate,
    /// Drop the example.
    Skip,
}

impl std::str::FromStr for Overflow {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "truncate" => Ok(Self::Truncate),
            "skip" => Ok(Self::Skip),
            other => Err(format!("expected truncate or skip, got {other:?}")),
        }
    }
}

/// One data row: its columns by name.
pub type Row = serde_json::Map<String, serde_json::Value>;

/// The columns `row` has, for an error saying what a row holds instead of what was expected (a
/// null column reads as absent: it is marked).
pub fn row_columns(row: &Row) -> String {
    let has: Vec<String> = row
        .iter()
        .map(|(k, v)| match v.is_null() {
            true => format!("{k:?} (null)"),
            false => format!("{k:?}"),
        })
        .collect();
    match has.is_empty() {
        true => "no columns".to_string(),
        false => has.join(", "),
    }
}

/// What loading a data file did to its rows: items cut or dropped to fit the length limit, and text the
/// tokenizer could not spell (its tokens became the unknown token). Reported once, when the file is
/// done, and a file left with nothing to train on is refused.
#[derive(Default)]
pub struct LoadReport {
    /// Items cut to fit the limit.
    pub truncated: usize,
    /// Items dropped: over the limit with `--overflow skip`, or nothing left to train on.
    pub skipped: usize,
    unknown: usize,
    first_unknown: Option<String>,
    identical: usize,
    first_identical: Option<String>,
}

impl LoadReport {
    /// Notes `ids`, the tokens of the item at `location`, if they hold the unknown token.
    pub fn note_unknown(&mut self, tok: &TextTokenizer, ids: &[u32], location: &str) {
        if tok.has_unknown(ids) {
            self.unknown += 1;
            self.first_unknown
                .get_or_insert_with(|| location.to_string());
        }
    }

    /// `example` (the item at `location`) as training keeps it, noted here: its unknown tokens; cut to
    /// `max_length` tokens, or dropped (`None`) over it with `--overflow skip`; dropped when no target
    /// token is left.
    pub fn fit(
        &mut self,
        tok: &TextTokenizer,
        mut example: Example,
        (max_length, overflow): (usize, Overflow),
        location: &str,
    ) -> Option<Example> {
        self.note_unknown(tok, &example.input_ids, location);
        if example.input_ids.len() > max_length {
            match overflow {
                Overflow::Skip => {
                    self.skipped += 1;
                    return None;
                }
                Overflow::Truncate => {
                    self.truncated += 1;
                    example.truncate(max_length);
                }
            }
        }
        if example.targets() == 0 {
            self.skipped += 1;
            return None;
        }
        Some(example)
    }

    /// Notes a preference pair at `location` dropped because its two sides are the same tokens: its
    /// loss would be ln 2 whatever the model, its gradient zero.
    pub fn note_identical(&mut self, location: &str) {
        self.identical += 1;
        self.first_identical
            .get_or_insert_with(|| location.to_string());
    }

    /// Warns about what was cut, dropped or unknown among the `what` (examples, pairs, prompts) of
    /// `source`, and refuses it when none of them is `kept`. `limit` names the length limit.
    pub fn finish(&self, source: &DataSource, what: &str, kept: usize, limit: &str) -> Result<()> {
        if let Some(first) = &self.first_unknown {
            tracing::warn!(
                count = self.unknown,
                first = first.as_str(),
                "{what} with text outside the tokenizer's vocabulary, encoded as its unknown token"
            );
        }
        if self.truncated > 0 {
            tracing::warn!(count = self.truncated, "{what} truncated to {limit}");
        }
        if self.skipped > 0 {
            tracing::warn!(
                count = self.skipped,
                "{what} skipped (longer than {limit}, or nothing left to train on)"
            );
        }
        if let Some(first) = &self.first_identical {
            tracing::warn!(
                count = self.identical,
                first = first.as_str(),
                "{what} skipped: chosen and rejected are the same tokens (no preference to learn)"
            );
        }
        match kept {
            0 if self.identical > 0 => Err(TrainError::data(
                source.name(),
                format!(
                    "no {what} left to train on: {} with chosen equal to rejected (first at {}), \
                     the rest over {limit}",
                    self.identical,
                    self.first_identical.as_deref().unwrap_or_default()
                ),
            )),
            0 => Err(TrainError::data(
                source.name(),
                format!("no {what} left to train on ({limit})"),
            )),
            _ => Ok(()),
        }
    }
}

/// A field of a data row: plain text, or a conversation (a list of `{role, content}` messages).
#[derive(Debug, Clone)]
pub enum Text {
    /// A string, tokenized as it is.
    Plain(String),
    /// A list of `{role, content}` messages, rendered with the chat template.
    Messages(Vec<serde_json::Value>),
}

/// The field `key` of the row at `location`, if present (null counts as absent: a Parquet column
/// other rows fill). Messages in ShareGPT's `{from, value}` form become `{role, content}`, as TRL's
/// `maybe_convert_to_chatml` does.
pub fn text_field(row: &Row, key: &str, location: &str) -> Result<Option<Text>> {
    match row.get(key) {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(s)) => Ok(Some(Text::Plain(s.clone()))),
        Some(serde_json::Value::Array(m)) => {
            Ok(Some(Text::Messages(m.iter().map(to_chatml).collect())))
        }
        Some(_) => Err(TrainError::data(
            location,
            format!("{key:?} must be a string or a list of messages"),
        )),
    }
}

/// A message with ShareGPT's keys (`from`, `value`) under ChatML's (`role`, `content`).
fn to_chatml(message: &serde_json::Value) -> serde_json::Value {
    let serde_json::Value::Object(m) = message else {
        return message.clone();
    };
    let mut m = m.clone();
    for (from, to) in [("from", "role"), ("value", "content")] {
        if !m.contains_key(to) {
            if let Some(v) = m.remove(from) {
                m.insert(to.to_string(), v);
            }
        }
    }
    serde_json::Value::Object(m)
}

/// Prompt and completion token ids of a (prompt, reply) pair. Plain text: the completion ends with EOS,
/// as TRL appends it. Conversations: rendered with the chat template, the prompt with the generation
/// prompt; the template writes the turn's end itself.
pub fn encode_pair(
    tok: &TextTokenizer,
    prompt: Text,
    reply: Text,
    max_length: usize,
    where_: &str,
) -> Result<(Vec<u32>, Vec<u32>)> {
    // Only the first `max_length` tokens of either part can be kept.
    let encode = |text: &str| tok.encode_at_most(text, max_length, Keep::Start);
    match (prompt, reply) {
        (Text::Plain(p), Text::Plain(c)) => {
            let mut completion = encode(&c)?;
            completion.push(tok.eos_id);
            Ok((encode(&p)?, completion))
        }
        (Text::Messages(p), Text::Messages(c)) => {
            let in_context = |e: TrainError| TrainError::data(where_, e.to_string());
            let (p, c) = tok
                .chat_template()
                .map_err(in_context)?
                .split(&p, &c)
                .map_err(in_context)?;
            Ok((encode(&p)?, encode(&c)?))
        }
        _ => Err(TrainError::data(
            where_,
            "prompt and completion must both be strings or both be messages",
        )),
    }
}

/// Tokenized SFT examples in TRL's formats: `messages` (or ShareGPT's `conversations`; the loss is on
/// the assistant turns, like TRL's `assistant_only_loss`), `prompt` + `completion` (strings or
/// messages; loss on the completion), or the `text_field` column (`text` by default; loss on every
/// token). Plain completions end with EOS.
pub fn load_sft(
    source: &DataSource,
    tokenizer: &TextTokenizer,
    max_length: usize,
    overflow: Overflow,
    text_field_name: &str,
) -> Result<Vec<Example>> {
    let mut out = Vec::new();
    let limits = (max_length, overflow);
    load_sft_into(source, tokenizer, limits, text_field_name, &mut out)?;
    Ok(out)
}

/// [`load_sft`] into `out`, one example at a time (a [`crate::token_store::StoreWriter`] keeps a
/// data set of any size on disk); `limits` are `--max-length` and `--overflow`.
pub fn load_sft_into(
    source: &DataSource,
    tokenizer: &TextTokenizer,
    (max_length, overflow): (usize, Overflow),
    text_field_name: &str,
    out: &mut impl ExampleSink,
) -> Result<()> {
    let mut report = LoadReport::default();
    let mut final_turn_only = 0usize;
    for row in source.rows() {
        let (at, row) = row?;
        let where_ = at.to_string();
        let field = |k: &str| text_field(&row, k, &where_);
        let messages = match field("messages")? {
            Some(m) => Some(m),
            None => field("conversations")?,
        };
        let example = match (
            messages,
            field("prompt")?,
            field("completion")?,
            field(text_field_name)?,
        ) {
            (Some(Text::Messages(m)), None, None, _) => {
                let (example, whole) = encode_conversation(tokenizer, &m, max_length, &where_)?;
                final_turn_only += usize::from(!whole);
                example
            }
            (None, Some(p), Some(c), _) => {
                let (p, c) = encode_pair(tokenizer, p, c, max_length, &where_)?;
                Example::from_pair(p, c)
            }
            (None, None, None, Some(Text::Plain(t))) => {
                let plain = Text::Plain(String::new());
                let (p, c) = encode_pair(tokenizer, plain, Text::Plain(t), max_length, &where_)?;
                Example::from_pair(p, c)
            }
            _ => {
                return Err(TrainError::data(
                    &where_,
                    format!(
                        "expected \"messages\" (or \"conversations\"), \"prompt\" and \"completion\", \
                         or a {text_field_name:?} string (--dataset-text-field); the row has {}",
                        row_columns(&row)
                    ),
                ));
            }
        };
        if let Some(example) = report.fit(tokenizer, example, (max_length, overflow), &where_) {
            out.push(example)?;
        }
    }
    if final_turn_only > 0 {
        tracing::warn!(
            final_turn_only,
            "the chat template renders earlier assistant turns differently once later turns follow; \
             those conversations train on their final assistant turn only"
        );
    }
    report.finish(
        source,
        "examples",
        out.count(),
        &format!("--max-length {max_length}"),
    )
}

/// Ids and labels of a conversation with the loss on every assistant turn, and whether every turn
/// could be told apart (else only the final assistant turn is trained, see
/// [`crate::chat::ChatTemplate::assistant_segments`]).
fn encode_conversation(
    tok: &TextTokenizer,
    messages: &[serde_json::Value],
    max_length: usize,
    where_: &str,
) -> Result<(Example, bool)> {
    let role = |m: &serde_json::Value| m.get("role").and_then(|r| r.as_str()).map(String::from);
    if !messages
        .iter()
        .any(|m| role(m).as_deref() == Some("assistant"))
    {
        return Err(TrainError::data(
            where_,
            "the conversation has no assistant message to train on",
        ));
    }
    let in_context = |e: TrainError| TrainError::data(where_, e.to_string());
    let chat = tok.chat_template().map_err(in_context)?;
    if let Some(segments) = chat.assistant_segments(messages).map_err(in_context)? {
        let (mut ids, mut labels) = (Vec::new(), Vec::new());
        for (text, trained) in segments {
            let piece = tok.encode_at_most(&text, max_length, Keep::Start)?;
            labels.extend(
                piece
                    .iter()
                    .map(|&t| if trained { t as i64 } else { IGNORE_INDEX }),
            );
            ids.extend(piece);
        }
        return Ok((Example::new(ids, labels), true));
    }
    let n = messages.len();
    if role(&messages[n - 1]).as_deref() != Some("assistant") {
        return Err(TrainError::data(
            where_,
            "the chat template cannot mark every assistant turn, and the conversation does not end \
             with one",
        ));
    }
    let pair = encode_pair(
        tok,
        Text::Messages(messages[..n - 1].to_vec()),
        Text::Messages(messages[n - 1..].to_vec()),
        max_length,
        where_,
    )?;
    Ok((Example::from_pair(pair.0, pair.1), false))
}
