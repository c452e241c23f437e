//! A distillation teacher: loaded and checked to fit the student, and its logits of a batch's
//! positions made on demand from its final hidden states, so that they never exist for the whole
//! sequence at once.

use std::ops::Range;
use std::sync::{Arc, Mutex};

use candle_core::Tensor;
use streambp_core::{forward_hidden, Batch, Chunks, Frozen, HiddenStates};
use streambp_dist::Communicator;
use streambp_models::{load_model, resolve_model_dir, Model};
use streambp_objectives::{ObjectiveError, TeacherLogits, TeacherSource};

use crate::{Result, TrainError};

/// The teacher `spec` (`--teacher`, a directory or hub id), checked to fit `student`: a causal LM
/// with the same vocabulary size (any hidden size or family), in the student's dtype and on its
/// device.
pub fn load_teacher(spec: &str, student: &Model) -> Result<Model> {
    if std::path::Path::new(spec).is_file() {
        return Err(TrainError::flag(
            "--teacher",
            spec,
            "a file; --teacher takes a model directory or a hub id",
        ));
    }
    let dir = resolve_model_dir(spec)?;
    let teacher = load_model(&dir, student.dtype(), student.device())?;
    if teacher.scores_positions() {
        return Err(TrainError::flag(
            "--teacher",
            spec,
            "a reward model (a sequence classifier); a teacher is a causal LM",
        ));
    }
    let (mine, theirs) = (student.config.vocab_size, teacher.config.vocab_size);
    if mine != theirs {
        return Err(TrainError::flag(
            "--teacher",
            spec,
            format!(
                "its vocabulary has {theirs} tokens, the model's {mine}: distillation compares \
                 the two next-token distributions over one vocabulary"
            ),
        ));
    }
    Ok(teacher)
}

/// The teacher's logits of `batch`'s positions: its forward without a graph (streamed over
/// `chunks.chunk`; each rank of a sequence `group` its spans of the rows, as the student's) keeps
/// its final-normed hidden states `[B, positions held, d]`; its head then runs on the positions
/// the loss asks for. The engine frees the hidden states once its head is done (they are made
/// again should another backward ask).
pub fn teacher_logits(
    teacher: &Model,
    batch: Batch,
    chunks: Chunks,
    group: Option<Arc<dyn Communicator>>,
) -> Result<TeacherLogits> {
    let forward = TeacherForward {
        teacher: teacher.detached(),
        input_ids: batch.input_ids.clone(),
        attention_mask: batch.attention_mask.cloned(),
        position_ids: batch.position_ids.cloned(),
        chunks,
        group,
        hidden: Mutex::new(None),
    };
    forward.hidden()?;
    Ok(Box::new(forward))
}

/// A teacher's forward on one batch, its final hidden states kept until released.
struct TeacherForward {
    teacher: Model,
    input_ids: Tensor,
    attention_mask: Option<Tensor>,
    position_ids: Option<Tensor>,
    chunks: Chunks,
    group: Option<Arc<dyn Communicator>>,
    hidden: Mutex<Option<Arc<HiddenStates>>>,
}

impl TeacherForward {
    /// The hidden states, made by the forward where none are kept.
    fn hidden(&self) -> Result<Arc<HiddenStates>> {
        let mut kept = self.hidden.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(hidden) = kept.as_ref() {
            return Ok(hidden.clone());
        }
        let batch = Batch {
            input_ids: &self.input_ids,
            attention_mask: self.attention_mask.as_ref(),
            position_ids: self.position_ids.as_ref(),
        };
        let made = forward_hidden(&self.teacher, batch, self.chunks, self.group.as_deref())?;
        Ok(kept.insert(Arc::new(made)).clone())
    }
}

impl TeacherSource for TeacherForward {
    fn logits(&self, cols: Range<usize>) -> std::result::Result<Tensor, ObjectiveError> {
        let failed = |e: String| ObjectiveError::Loss(format!("the teacher's logits: {e}"));
        let hidden = self.hidden().map_err(|e| failed(e.to_string()))?;
        let normed = hidden.positions(cols).map_err(|e| failed(e.to_string()))?;
        self.teacher
            .logits(&normed)
            .map_err(|e| failed(e.to_string()))
    }

    fn release(&self) {
        *self.hidden.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }
}

/// What `teacher` holds beside `student` during the student's backward, for the planner: its
/// weights, its final hidden states, and its share of each logits chunk.
pub fn frozen_memory(teacher: &Model, student: &Model) -> Frozen {
    Frozen::teacher(&teacher.config, teacher.dtype(), student.dtype())
}

/// A [`crate::batch_file::Teacher`] of `teacher` with `chunks`.
pub fn teacher_of(
    teacher: &Model,
    chunks: Chunks,
) -> impl FnMut(&Tensor, Option<&Tensor>) -> Result<TeacherLogits> + '_ {
    move |ids, mask| teacher_logits(teacher, Batch::new(ids, mask), chunks, None)
}
