//! GGUF reader: header, typed metadata, tensor directory, and weights as views of the mmap.
//!
//! Every length and offset read from the file is checked against the bytes that remain, so a
//! truncated or corrupt file produces an error naming what is wrong, never a panic.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use dflash_runtime::{DType, HostWeight, WeightBytes};

use crate::error::{ModelError, Result};

const MAGIC: u32 = 0x4655_4747; // "GGUF" little-endian
const DEFAULT_ALIGNMENT: u64 = 32;
const MAX_DIMS: u32 = 4;

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    Str(String),
    Array(Vec<MetaValue>),
}

impl MetaValue {
    /// The value as an unsigned integer, when it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::U8(v) => Some(v as u64),
            MetaValue::U16(v) => Some(v as u64),
            MetaValue::U32(v) => Some(v as u64),
            MetaValue::U64(v) => Some(v),
            MetaValue::I8(v) => u64::try_from(v).ok(),
            MetaValue::I16(v) => u64::try_from(v).ok(),
            MetaValue::I32(v) => u64::try_from(v).ok(),
            MetaValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v as f64),
            MetaValue::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// One entry of the tensor directory.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    /// GGML dims: `dims[0]` is the innermost (contiguous) dimension.
    pub dims: Vec<u64>,
    pub ggml_type: u32,
    /// Absolute byte range in the file.
    pub start: u64,
    pub len: u64,
}

/// An opened GGUF file.
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: BTreeMap<String, MetaValue>,
    pub tensors: BTreeMap<String, TensorInfo>,
    bytes: Arc<dyn AsRef<[u8]> + Send + Sync>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn corrupt(&self, what: impl Into<String>) -> ModelError {
        ModelError::Corrupt {
            path: self.path.to_path_buf(),
            what: what.into(),
        }
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        if n > self.bytes.len() - self.pos {
            return Err(self.corrupt(format!(
                "file ends inside {what} (needs {n} bytes at offset {}, {} remain)",
                self.pos,
                self.bytes.len() - self.pos
            )));
        }
        let s = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.take(1, what)?[0])
    }
    fn u16(&mut self, what: &str) -> Result<u16> {
        Ok(u16::from_le_bytes(self.take(2, what)?.try_into().unwrap()))
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4, what)?.try_into().unwrap()))
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8, what)?.try_into().unwrap()))
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let len = self.u64(what)?;
        let len =
            usize::try_from(len).map_err(|_| self.corrupt(format!("{what}: length {len}")))?;
        let raw = self.take(len, what)?;
        String::from_utf8(raw.to_vec()).map_err(|_| self.corrupt(format!("{what} is not UTF-8")))
    }

    fn value(&mut self, ty: u32, key: &str, depth: usize) -> Result<MetaValue> {
        Ok(match ty {
            0 => MetaValue::U8(self.u8(key)?),
            1 => MetaValue::I8(self.u8(key)? as i8),
            2 => MetaValue::U16(self.u16(key)?),
            3 => MetaValue::I16(self.u16(key)? as i16),
            4 => MetaValue::U32(self.u32(key)?),
            5 => MetaValue::I32(self.u32(key)? as i32),
            6 => MetaValue::F32(f32::from_bits(self.u32(key)?)),
            7 => MetaValue::Bool(self.u8(key)? != 0),
            8 => MetaValue::Str(self.string(key)?),
            9 => {
                if depth > 2 {
                    return Err(self.corrupt(format!("metadata `{key}`: arrays nested too deep")));
                }
                let elem = self.u32(key)?;
                let count = self.u64(key)?;
                // Every element takes at least one byte: a count beyond the remaining bytes
                // can only be corruption (and must not drive a huge allocation).
                if count > (self.bytes.len() - self.pos) as u64 {
                    return Err(self.corrupt(format!(
                        "metadata `{key}`: array of {count} elements exceeds the file"
                    )));
                }
                let mut items = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    items.push(self.value(elem, key, depth + 1)?);
                }
                MetaValue::Array(items)
            }
            10 => MetaValue::U64(self.u64(key)?),
            11 => MetaValue::I64(self.u64(key)? as i64),
            12 => MetaValue::F64(f64::from_bits(self.u64(key)?)),
            other => {
                return Err(self.corrupt(format!("metadata `{key}` has unknown value type {other}")))
            }
        })
    }
}

impl GgufFile {
    /// Memory-maps and parses `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let file = std::fs::File::open(path).map_err(|e| ModelError::io(path, e))?;
        // SAFETY: the mapping is read-only; a file changed underneath us is outside our contract.
        let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| ModelError::io(path, e))?;
        Self::parse(path, Arc::new(mmap))
    }

    /// Parses GGUF bytes held by `bytes` (`path` names them in errors).
    pub fn parse(path: &Path, bytes: Arc<dyn AsRef<[u8]> + Send + Sync>) -> Result<Self> {
        let data: &[u8] = (*bytes).as_ref();
        let mut c = Cursor {
            bytes: data,
            pos: 0,
            path,
        };
        if data.len() < 4 {
            return Err(c.corrupt("file is shorter than the GGUF magic"));
        }
        let magic = c.u32("magic")?;
        if magic != MAGIC {
            return Err(ModelError::NotGguf {
                path: path.to_path_buf(),
                magic,
            });
        }
        let version = c.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(ModelError::GgufVersion {
                path: path.to_path_buf(),
                version,
            });
        }
        let n_tensors = c.u64("tensor count")?;
        let n_kv = c.u64("metadata count")?;
        let remaining = (data.len() - c.pos) as u64;
        if n_tensors > remaining / 8 || n_kv > remaining / 8 {
            return Err(c.corrupt(format!(
                "header claims {n_tensors} tensors and {n_kv} metadata entries, more than the file can hold"
            )));
        }
        let mut metadata = BTreeMap::new();
        for i in 0..n_kv {
            let key = c.string(&format!("metadata key #{i}"))?;
            let ty = c.u32(&key)?;
            let value = c.value(ty, &key, 0)?;
            metadata.insert(key, value);
        }
        let mut infos = Vec::with_capacity(n_tensors as usize);
        for i in 0..n_tensors {
            let name = c.string(&format!("tensor name #{i}"))?;
            let n_dims = c.u32(&name)?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(c.corrupt(format!("tensor `{name}` has {n_dims} dimensions")));
            }
            let dims = (0..n_dims)
                .map(|_| c.u64(&name))
                .collect::<Result<Vec<_>>>()?;
            let ggml_type = c.u32(&name)?;
            let offset = c.u64(&name)?;
            infos.push((name, dims, ggml_type, offset));
        }
        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_u64() {
                Some(a) if a.is_power_of_two() => a,
                _ => {
                    return Err(ModelError::BadMetadata {
                        key: "general.alignment".into(),
                        reason: "must be a power of two".into(),
                    })
                }
            },
        };
        let data_start = (c.pos as u64).div_ceil(alignment) * alignment;
        let file_len = data.len() as u64;
        let mut tensors = BTreeMap::new();
        for (name, dims, ggml_type, offset) in infos {
            let n_values = dims
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .ok_or_else(|| c.corrupt(format!("tensor `{name}` dimensions overflow")))?;
            let len = match DType::from_ggml_id(ggml_type) {
                Some(dt) => {
                    let block = dt.block_len() as u64;
                    if dims[0] % block != 0 {
                        return Err(c.corrupt(format!(
                            "tensor `{name}`: row of {} values is not a whole number of {dt} blocks",
                            dims[0]
                        )));
                    }
                    (n_values / block)
                        .checked_mul(dt.block_bytes() as u64)
                        .ok_or_else(|| c.corrupt(format!("tensor `{name}` size overflows")))?
                }
                // Unknown types: size is unknown; checked when (if) the tensor is used.
                None => 0,
            };
            let start = data_start
                .checked_add(offset)
                .ok_or_else(|| c.corrupt(format!("tensor `{name}` offset overflows")))?;
            let end = start.saturating_add(len);
            if end > file_len || offset % alignment != 0 {
                return Err(ModelError::TensorOutOfBounds {
                    path: path.to_path_buf(),
                    name,
                    start,
                    end,
                    file_len,
                });
            }
            let info = TensorInfo {
                name: name.clone(),
                dims,
                ggml_type,
                start,
                len,
            };
            if tensors.insert(name.clone(), info).is_some() {
                return Err(c.corrupt(format!("tensor `{name}` appears twice")));
            }
        }
        Ok(Self {
            path: path.to_path_buf(),
            version,
            metadata,
            tensors,
            bytes,
        })
    }

    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    fn required(&self, key: &str) -> Result<&MetaValue> {
        self.get(key).ok_or_else(|| ModelError::MissingMetadata {
            key: key.to_string(),
        })
    }

    fn bad(key: &str, reason: &str) -> ModelError {
        ModelError::BadMetadata {
            key: key.to_string(),
            reason: reason.to_string(),
        }
    }

    pub fn str(&self, key: &str) -> Result<&str> {
        self.required(key)?
            .as_str()
            .ok_or_else(|| Self::bad(key, "expected a string"))
    }

    pub fn u64(&self, key: &str) -> Result<u64> {
        self.required(key)?
            .as_u64()
            .ok_or_else(|| Self::bad(key, "expected a non-negative integer"))
    }

    pub fn f64(&self, key: &str) -> Result<f64> {
        self.required(key)?
            .as_f64()
            .ok_or_else(|| Self::bad(key, "expected a number"))
    }

    pub fn opt_u64(&self, key: &str) -> Result<Option<u64>> {
        self.get(key)
            .map(|v| {
                v.as_u64()
                    .ok_or_else(|| Self::bad(key, "expected an integer"))
            })
            .transpose()
    }

    pub fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        self.get(key)
            .map(|v| {
                v.as_f64()
                    .ok_or_else(|| Self::bad(key, "expected a number"))
            })
            .transpose()
    }

    /// A string array (e.g. the vocabulary).
    pub fn str_array(&self, key: &str) -> Result<Vec<&str>> {
        let arr = self
            .required(key)?
            .as_array()
            .ok_or_else(|| Self::bad(key, "expected an array"))?;
        arr.iter()
            .map(|v| v.as_str().ok_or_else(|| Self::bad(key, "expected strings")))
            .collect()
    }

    /// An integer array (e.g. token types).
    pub fn int_array(&self, key: &str) -> Result<Vec<i64>> {
        let arr = self
            .required(key)?
            .as_array()
            .ok_or_else(|| Self::bad(key, "expected an array"))?;
        arr.iter()
            .map(|v| match *v {
                MetaValue::I32(x) => Ok(x as i64),
                MetaValue::I64(x) => Ok(x),
                _ => v
                    .as_u64()
                    .map(|x| x as i64)
                    .ok_or_else(|| Self::bad(key, "expected integers")),
            })
            .collect()
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Tensor `name` as a 2-D weight `[rows, cols]` (GGML dims `[cols, rows]`; 1-D tensors are
    /// one row), checking its shape against `expect` (`[rows, cols]`) when given.
    pub fn weight(&self, name: &str, expect: Option<[usize; 2]>) -> Result<HostWeight> {
        let info = self
            .tensors
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor {
                name: name.to_string(),
            })?;
        let dtype = DType::from_ggml_id(info.ggml_type).ok_or_else(|| {
            ModelError::UnsupportedTensorType {
                name: name.to_string(),
                dtype: DType::ggml_name(info.ggml_type).to_string(),
            }
        })?;
        let cols = info.dims[0] as usize;
        let rows = info.dims[1..].iter().product::<u64>() as usize;
        if let Some(exp) = expect {
            if exp != [rows, cols] {
                return Err(ModelError::TensorShape {
                    name: name.to_string(),
                    expected: exp.to_vec(),
                    found: vec![rows, cols],
                });
            }
        }
        let range = info.start as usize..(info.start + info.len) as usize;
        Ok(HostWeight::new(
            name,
            dtype,
            rows,
            cols,
            WeightBytes::new(self.bytes.clone(), range),
        )?)
    }
}

#[cfg(test)]
mod tests;
