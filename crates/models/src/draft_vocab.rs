//! A drafter's vocabulary shortlist (as in FR-Spec and EAGLE-3's reduced draft vocabulary):
//! target token ids ranked by how often the target writes them, shipped beside the drafter as
//! `draft_vocab.safetensors` (one 1-D integer tensor `ids`, most frequent first, made by
//! `tools/rank_draft_vocab.py`). A drafter using the first K computes its logits over those K
//! tokens only, through a head made of the same K rows of the target's output head in their
//! stored format ([`gather_rows`]); verification is unchanged, so greedy output stays the
//! target's own.

use std::path::Path;

use dflash_runtime::weight::{HostWeight, WeightBytes};
use safetensors::{Dtype, SafeTensors};

use crate::error::{ModelError, Result};

/// The file name of the shortlist inside a drafter directory.
pub const DRAFT_VOCAB_FILE: &str = "draft_vocab.safetensors";

/// The tensor holding the ranked ids.
const IDS_TENSOR: &str = "ids";

/// Target token ids, most frequent first (distinct).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DraftVocab {
    ids: Vec<u32>,
}

impl DraftVocab {
    /// Ranked ids (checked distinct and non-empty; [`DraftVocab::check`] bounds them).
    pub fn new(ids: Vec<u32>) -> Result<Self> {
        if ids.is_empty() {
            return Err(ModelError::Config("the draft vocabulary is empty".into()));
        }
        let mut seen = vec![false; ids.iter().max().map_or(0, |&m| m as usize + 1)];
        for &id in &ids {
            if std::mem::replace(&mut seen[id as usize], true) {
                return Err(ModelError::Config(format!(
                    "the draft vocabulary lists token {id} twice"
                )));
            }
        }
        Ok(Self { ids })
    }

    /// Reads a shortlist file (tensor `ids`: I32, U32 or I64, one dimension).
    pub fn read(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|e| ModelError::io(path, e))?;
        let corrupt = |what: String| ModelError::Corrupt {
            path: path.to_path_buf(),
            what,
        };
        let st = SafeTensors::deserialize(&bytes).map_err(|e| corrupt(e.to_string()))?;
        let t = st
            .tensor(IDS_TENSOR)
            .map_err(|_| corrupt(format!("no tensor `{IDS_TENSOR}`")))?;
        if t.shape().len() != 1 {
            return Err(corrupt(format!(
                "`{IDS_TENSOR}` has shape {:?}, expected one dimension",
                t.shape()
            )));
        }
        let data = t.data();
        let ids: Vec<i64> = match t.dtype() {
            Dtype::I32 => data
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes(c.try_into().expect("4 bytes")) as i64)
                .collect(),
            Dtype::U32 => data
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")) as i64)
                .collect(),
            Dtype::I64 => data
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
                .collect(),
            d => {
                return Err(corrupt(format!(
                    "`{IDS_TENSOR}` has type {d:?}, expected I32, U32 or I64"
                )))
            }
        };
        let ids = ids
            .into_iter()
            .map(|id| u32::try_from(id).map_err(|_| corrupt(format!("token id {id} is invalid"))))
            .collect::<Result<Vec<u32>>>()?;
        Self::new(ids).map_err(|e| corrupt(e.to_string()))
    }

    /// Writes the shortlist as `path` (tensor `ids`, I32).
    pub fn write(&self, path: &Path) -> Result<()> {
        let data: Vec<u8> = self
            .ids
            .iter()
            .flat_map(|&id| (id as i32).to_le_bytes())
            .collect();
        let view = safetensors::tensor::TensorView::new(Dtype::I32, vec![self.ids.len()], &data)
            .map_err(|e| ModelError::Config(e.to_string()))?;
        safetensors::serialize_to_file([(IDS_TENSOR, view)], None, path)
            .map_err(|e| ModelError::io(path, std::io::Error::other(e.to_string())))
    }

    /// Every id is a token of a `vocab`-token target.
    pub fn check(&self, vocab: usize) -> Result<()> {
        match self.ids.iter().find(|&&id| id as usize >= vocab) {
            Some(id) => Err(ModelError::IncompatibleDrafter(format!(
                "the draft vocabulary lists token {id}, but the target has {vocab} tokens"
            ))),
            None => Ok(()),
        }
    }

    /// How many ids the file ranks.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// The `k` most frequent ids.
    pub fn top(&self, k: usize) -> Result<&[u32]> {
        if k == 0 || k > self.ids.len() {
            return Err(ModelError::Config(format!(
                "a draft vocabulary of {k} tokens was asked for; the file ranks {} (use 1..={0}, \
                 or 0 for the full vocabulary)",
                self.ids.len()
            )));
        }
        Ok(&self.ids[..k])
    }
}

/// Rows `ids` of `w`, in that order, in `w`'s stored format: a quantized row is whole blocks
/// along the columns, so rows are copied byte for byte and multiply exactly as they did.
pub fn gather_rows(w: &HostWeight, ids: &[u32]) -> Result<HostWeight> {
    if let Some(&id) = ids.iter().find(|&&id| id as usize >= w.rows) {
        return Err(ModelError::Config(format!(
            "row {id} of `{}` was asked for; it has {} rows",
            w.name, w.rows
        )));
    }
    let mut bytes = Vec::with_capacity(ids.len() * w.row_bytes());
    for &id in ids {
        bytes.extend_from_slice(w.row(id as usize));
    }
    Ok(HostWeight::new(
        format!("{} (rows of the draft vocabulary)", w.name),
        w.dtype,
        ids.len(),
        w.cols,
        WeightBytes::from_vec(bytes),
    )?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use dflash_runtime::DType;

    fn write(path: &Path, dtype: Dtype, shape: Vec<usize>, data: &[u8]) {
        let view = safetensors::tensor::TensorView::new(dtype, shape, data).unwrap();
        safetensors::serialize_to_file([(IDS_TENSOR, view)], None, path).unwrap();
    }

    #[test]
    fn reads_ranked_ids_of_each_integer_type() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join(DRAFT_VOCAB_FILE);
        let ids = [2u32, 0, 7];
        let i32s: Vec<u8> = ids.iter().flat_map(|&i| (i as i32).to_le_bytes()).collect();
        let i64s: Vec<u8> = ids.iter().flat_map(|&i| (i as i64).to_le_bytes()).collect();
        let u32s: Vec<u8> = ids.iter().flat_map(|&i| i.to_le_bytes()).collect();
        for (dt, data) in [(Dtype::I32, i32s), (Dtype::I64, i64s), (Dtype::U32, u32s)] {
            write(&p, dt, vec![3], &data);
            let v = DraftVocab::read(&p).unwrap();
            assert_eq!(v.top(3).unwrap(), &ids);
            assert_eq!(v.top(2).unwrap(), &ids[..2]);
        }
        let v = DraftVocab::new(vec![9, 3, 5]).unwrap();
        v.write(&p).unwrap();
        assert_eq!(DraftVocab::read(&p).unwrap(), v);
    }

    #[test]
    fn bad_files_and_requests_give_clear_errors() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join(DRAFT_VOCAB_FILE);
        let e = DraftVocab::read(&p).unwrap_err().to_string();
        assert!(e.contains("cannot read"), "{e}");
        std::fs::write(&p, b"not a safetensors file").unwrap();
        let e = DraftVocab::read(&p).unwrap_err().to_string();
        assert!(e.contains("truncated or corrupt"), "{e}");
        write(&p, Dtype::F32, vec![1], &1f32.to_le_bytes());
        let e = DraftVocab::read(&p).unwrap_err().to_string();
        assert!(e.contains("expected I32"), "{e}");
        write(&p, Dtype::I32, vec![1], &(-3i32).to_le_bytes());
        let e = DraftVocab::read(&p).unwrap_err().to_string();
        assert!(e.contains("-3"), "{e}");
        let dup: Vec<u8> = [4i32, 4].iter().flat_map(|i| i.to_le_bytes()).collect();
        write(&p, Dtype::I32, vec![2], &dup);
        let e = DraftVocab::read(&p).unwrap_err().to_string();
        assert!(e.contains("twice"), "{e}");

        let v = DraftVocab::new(vec![5, 1]).unwrap();
        assert!(v.check(6).is_ok());
        let e = v.check(5).unwrap_err().to_string();
        assert!(e.contains("5 tokens"), "{e}");
        let e = v.top(3).unwrap_err().to_string();
        assert!(e.contains("ranks 2"), "{e}");
        assert!(v.top(0).is_err());
    }

    #[test]
    fn gathered_rows_are_the_stored_rows_in_order() {
        // Two Q8_0 blocks per row (34 bytes each): rows are copied as whole blocks.
        let (rows, cols) = (5, 64);
        let rb = DType::Q8_0.row_bytes(cols).unwrap();
        let bytes: Vec<u8> = (0..rows * rb).map(|i| (i * 7 % 251) as u8).collect();
        let w = HostWeight::new(
            "head",
            DType::Q8_0,
            rows,
            cols,
            WeightBytes::from_vec(bytes),
        )
        .unwrap();
        let g = gather_rows(&w, &[3, 0, 4]).unwrap();
        assert_eq!((g.dtype, g.rows, g.cols), (DType::Q8_0, 3, cols));
        for (i, &r) in [3usize, 0, 4].iter().enumerate() {
            assert_eq!(g.row(i), w.row(r));
        }
        let e = gather_rows(&w, &[5]).unwrap_err().to_string();
        assert!(e.contains("5 rows"), "{e}");
    }
}
