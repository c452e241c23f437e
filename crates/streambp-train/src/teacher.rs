//! A distillation teacher: loaded and checked to fit the student, and its logits of a batch's
//! positions made on demand from its final hidden states, so that they never exist for the whole
//! sequence at once.

use std::ops::Range;

use candle_core::Tensor;
use streambp_core::{forward_hidden, Batch, Chunks, Frozen};
use streambp_dist::Communicator;
use streambp_models::{load_model, resolve_model_dir, Model};
use streambp_objectives::{ObjectiveError, TeacherLogits};

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
/// the loss asks for.
pub fn teacher_logits(
    teacher: &Model,
    batch: Batch,
    chunks: Chunks,
    group: Option<&dyn Communicator>,
) -> Result<TeacherLogits> {
    let hidden = forward_hidden(teacher, batch, chunks, group)?;
    let teacher = teacher.detached();
    let failed = |e: String| ObjectiveError::Loss(format!("the teacher's logits: {e}"));
    Ok(Box::new(move |cols: Range<usize>| {
        let normed = hidden.positions(cols).map_err(|e| failed(e.to_string()))?;
        teacher.logits(&normed).map_err(|e| failed(e.to_string()))
    }))
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
