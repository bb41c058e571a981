//! Safetensors files of a Hugging Face model directory: one `model.safetensors` or shards
//! listed by `model.safetensors.index.json`, memory-mapped.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use dflash_runtime::{DType, HostWeight, WeightBytes};
use safetensors::tensor::Dtype as StDtype;

use super::TensorSource;
use crate::error::{ModelError, Result};

struct Entry {
    file: usize,
    dtype: StDtype,
    shape: Vec<usize>,
    range: std::ops::Range<usize>,
}

/// All tensors of a directory's safetensors files.
pub struct SafetensorsDir {
    files: Vec<(PathBuf, Arc<memmap2::Mmap>)>,
    entries: HashMap<String, Entry>,
}

impl SafetensorsDir {
    /// Opens the safetensors files of `dir` (sharded or not).
    pub fn open(dir: &Path) -> Result<Self> {
        let index = dir.join("model.safetensors.index.json");
        let names: Vec<PathBuf> = if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(|e| ModelError::io(&index, e))?;
            let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
                ModelError::Config(format!("{} is not valid JSON: {e}", index.display()))
            })?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| {
                    ModelError::Config(format!("{} has no weight_map", index.display()))
                })?;
            let mut files: Vec<String> = map
                .values()
                .filter_map(|f| f.as_str().map(str::to_string))
                .collect();
            files.sort();
            files.dedup();
            files.into_iter().map(|f| dir.join(f)).collect()
        } else {
            let single = dir.join("model.safetensors");
            if single.exists() {
                vec![single]
            } else {
                let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
                    .map_err(|e| ModelError::io(dir, e))?
                    .filter_map(|e| e.ok().map(|e| e.path()))
                    .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                    .collect();
                found.sort();
                found
            }
        };
        if names.is_empty() {
            return Err(ModelError::Config(format!(
                "{} holds no .safetensors files",
                dir.display()
            )));
        }
        let mut files = Vec::new();
        let mut entries = HashMap::new();
        for (fi, path) in names.into_iter().enumerate() {
            let file = std::fs::File::open(&path).map_err(|e| ModelError::io(&path, e))?;
            // SAFETY: read-only mapping of a file we do not modify.
            let mmap =
                unsafe { memmap2::Mmap::map(&file) }.map_err(|e| ModelError::io(&path, e))?;
            let (header_len, meta) =
                safetensors::SafeTensors::read_metadata(&mmap[..]).map_err(|e| {
                    ModelError::Corrupt {
                        path: path.clone(),
                        what: format!("safetensors header: {e}"),
                    }
                })?;
            let base = 8 + header_len;
            for (name, info) in meta.tensors() {
                let (s, e) = info.data_offsets;
                if base + e > mmap.len() || s > e {
                    return Err(ModelError::TensorOutOfBounds {
                        path: path.clone(),
                        name,
                        start: (base + s) as u64,
                        end: (base + e) as u64,
                        file_len: mmap.len() as u64,
                    });
                }
                entries.insert(
                    name,
                    Entry {
                        file: fi,
                        dtype: info.dtype,
                        shape: info.shape.clone(),
                        range: base + s..base + e,
                    },
                );
            }
            files.push((path, Arc::new(mmap)));
        }
        Ok(Self { files, entries })
    }

    /// Names of all tensors.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }
}

impl TensorSource for SafetensorsDir {
    fn weight(&self, name: &str, expect: Option<[usize; 2]>) -> Result<HostWeight> {
        let e = self
            .entries
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor {
                name: name.to_string(),
            })?;
        let dtype = match e.dtype {
            StDtype::F32 => DType::F32,
            StDtype::F16 => DType::F16,
            StDtype::BF16 => DType::BF16,
            other => {
                return Err(ModelError::UnsupportedTensorType {
                    name: name.to_string(),
                    dtype: format!("{other:?}"),
                })
            }
        };
        // N-D tensors are read as [product of the leading dims, last dim] (a conv kernel
        // [C, 1, K] is C rows of K), as GGUF does.
        let (rows, cols) = match e.shape.as_slice() {
            [c] => (1, *c),
            [r, c] => (*r, *c),
            [lead @ .., c] if !lead.is_empty() => (lead.iter().product(), *c),
            other => {
                return Err(ModelError::TensorShape {
                    name: name.to_string(),
                    expected: expect.map(|x| x.to_vec()).unwrap_or_default(),
                    found: other.to_vec(),
                })
            }
        };
        if let Some(exp) = expect {
            if exp != [rows, cols] {
                return Err(ModelError::TensorShape {
                    name: name.to_string(),
                    expected: exp.to_vec(),
                    found: vec![rows, cols],
                });
            }
        }
        let owner = self.files[e.file].1.clone();
        Ok(HostWeight::new(
            name,
            dtype,
            rows,
            cols,
            WeightBytes::new(owner, e.range.clone()),
        )?)
    }

    fn has(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    fn dims(&self, name: &str) -> Option<Vec<usize>> {
        self.entries.get(name).map(|e| e.shape.clone())
    }
}
