//! Checks on a GGUF file that candle's reader leaves out: a corrupt file must fail with an
//! error naming the problem, never a panic, an abort on a wild allocation, or silently wrong
//! weights.

use std::fs::File;
use std::io::{BufRead, BufReader, Seek, SeekFrom};

use candle_core::quantized::gguf_file;

/// What a walk over a GGUF file's header finds that candle's reader does not keep.
#[derive(Debug, Default)]
pub(crate) struct Scan {
    /// The `general.alignment` the file declares, read the way candle reads it (an integer
    /// type of at most 32 bits, not negative), or None when absent, of another type, or
    /// unreadable.
    pub alignment: Option<u64>,
    /// The first metadata key that appears twice (candle keeps the last; llama.cpp refuses
    /// the file).
    pub duplicate_key: Option<String>,
    /// The tensors' names in header order, when the walk read every tensor's entry.
    pub tensors: Option<Vec<String>>,
    /// The first tensor whose GGML type candle cannot read (its name and type id): candle's
    /// reader would refuse the file as "unknown dtype for tensor 23" (the type's id).
    pub unreadable: Option<(String, u32)>,
}

/// GGML's type names by id (`ggml.h`), for messages; `None` for ids no longer used.
pub(crate) fn ggml_type_name(id: u32) -> Option<&'static str> {
    const NAMES: [&str; 40] = [
        "F32", "F16", "Q4_0", "Q4_1", "", "", "Q5_0", "Q5_1", "Q8_0", "Q8_1", "Q2_K", "Q3_K",
        "Q4_K", "Q5_K", "Q6_K", "Q8_K", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ4_NL", "IQ3_S",
        "IQ2_S", "IQ4_XS", "I8", "I16", "I32", "I64", "F64", "IQ1_M", "BF16", "", "", "", "TQ1_0",
        "TQ2_0", "", "", "", "MXFP4",
    ];
    NAMES.get(id as usize).copied().filter(|n| !n.is_empty())
}

/// Walks a GGUF file's header (see [`Scan`]) and leaves the file at its start.
///
/// candle divides by the alignment unchecked (huggingface/candle#3876, open as of 0.11.1),
/// so a file declaring 0 panics inside `Content::read`: this walk comes first, skipping
/// values. It follows candle's reading: both magics, strings without trailing NULs and
/// decoded lossily, nesting to depth 64. Where it cannot follow the file, candle cannot
/// either, and reports it.
pub(crate) fn scan(file: &mut File) -> std::io::Result<Scan> {
    let len = file.metadata()?.len();
    file.seek(SeekFrom::Start(0))?;
    let mut found = Scan::default();
    {
        let mut w = Walker {
            r: BufReader::new(&mut *file),
            long: true,
            len,
        };
        let _ = w.walk(&mut found);
    }
    file.seek(SeekFrom::Start(0))?;
    Ok(found)
}

struct Walker<R> {
    r: R,
    /// Lengths and counts are u64 (GGUF v2, v3) rather than u32 (v1).
    long: bool,
    len: u64,
}

type Io<T> = std::io::Result<T>;

fn invalid(what: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_string())
}

impl<R: BufRead + Seek> Walker<R> {
    fn bytes<const N: usize>(&mut self) -> Io<[u8; N]> {
        let mut b = [0u8; N];
        self.r.read_exact(&mut b)?;
        Ok(b)
    }

    fn u32(&mut self) -> Io<u32> {
        Ok(u32::from_le_bytes(self.bytes()?))
    }

    /// A length or count, refused past the file's size (no valid file has more of anything).
    fn count(&mut self) -> Io<u64> {
        let n = if self.long {
            u64::from_le_bytes(self.bytes()?)
        } else {
            u64::from(self.u32()?)
        };
        if n > self.len {
            return Err(invalid("count beyond the file size"));
        }
        Ok(n)
    }

    fn skip(&mut self, n: u64) -> Io<()> {
        let n = i64::try_from(n).map_err(|_| invalid("skip beyond i64"))?;
        self.r.seek_relative(n)
    }

    /// A string as candle reads it: trailing NULs dropped, decoded lossily.
    fn string(&mut self) -> Io<String> {
        let n = self.count()?;
        let mut b = vec![0u8; n as usize];
        self.r.read_exact(&mut b)?;
        while b.last() == Some(&0) {
            b.pop();
        }
        Ok(String::from_utf8_lossy(&b).into_owned())
    }

    /// Fills `found` as far as the file can be followed (seen so far is kept when the walk
    /// fails part-way; candle then reports the failure).
    fn walk(&mut self, found: &mut Scan) -> Io<()> {
        // candle reads both byte orders of the magic, and little-endian values after either.
        if !matches!(u32::from_le_bytes(self.bytes()?), 0x4655_4747 | 0x4747_5546) {
            return Ok(());
        }
        self.long = match self.u32()? {
            1 => false,
            2 | 3 => true,
            _ => return Ok(()),
        };
        let tensors = self.count()?;
        let entries = self.count()?;
        let mut keys = std::collections::HashSet::new();
        for _ in 0..entries {
            let key = self.string()?;
            let ty = self.u32()?;
            if key == "general.alignment" {
                let value = match ty {
                    0 => Some(u64::from(self.bytes::<1>()?[0])),
                    1 => u64::try_from(i8::from_le_bytes(self.bytes()?)).ok(),
                    2 => Some(u64::from(u16::from_le_bytes(self.bytes()?))),
                    3 => u64::try_from(i16::from_le_bytes(self.bytes()?)).ok(),
                    4 => Some(u64::from(self.u32()?)),
                    5 => u64::try_from(i32::from_le_bytes(self.bytes()?)).ok(),
                    _ => {
                        self.skip_value(ty, 0)?;
                        None
                    }
                };
                // A value candle does not take as the alignment leaves its default.
                found.alignment = value;
            } else {
                self.skip_value(ty, 0)?;
            }
            if !keys.insert(key.clone()) && found.duplicate_key.is_none() {
                found.duplicate_key = Some(key);
            }
        }
        let mut names = Vec::new();
        for _ in 0..tensors {
            let name = self.string()?;
            let dims = self.u32()?;
            if dims > 4 {
                return Ok(());
            }
            self.skip(u64::from(dims) * if self.long { 8 } else { 4 })?;
            let ty = self.u32()?;
            // The ids candle's `GgmlDType::from_u32` reads (candle 0.11).
            let candle_reads = matches!(ty, 0..=3 | 6..=15 | 30);
            if found.unreadable.is_none() && !candle_reads {
                found.unreadable = Some((name.clone(), ty));
            }
            // The offset.
            self.skip(8)?;
            names.push(name);
        }
        found.tensors = Some(names);
        Ok(())
    }

    fn skip_value(&mut self, ty: u32, depth: usize) -> Io<()> {
        match ty {
            0 | 1 | 7 => self.skip(1),
            2 | 3 => self.skip(2),
            4..=6 => self.skip(4),
            10..=12 => self.skip(8),
            8 => {
                let n = self.count()?;
                self.skip(n)
            }
            // candle's limit on nesting.
            9 if depth <= 64 => {
                let elem = self.u32()?;
                let n = self.count()?;
                let size = match elem {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    10..=12 => 8,
                    _ => {
                        for _ in 0..n {
                            self.skip_value(elem, depth + 1)?;
                        }
                        return Ok(());
                    }
                };
                self.skip(n.checked_mul(size).ok_or_else(|| invalid("array size"))?)
            }
            _ => Err(invalid("unknown value type")),
        }
    }
}

/// Checks each GGUF tensor's extent as llama.cpp's loader does: the element count and byte
/// size fit in 64 bits, rows are whole quantization blocks, data starts aligned, lies inside
/// the file, and the tensors are packed one after another. A corrupt count, type or offset
/// then fails here with the tensor's name, instead of as a wild allocation or as another
/// tensor's bytes. Bytes after the last tensor are allowed, as llama.cpp allows them, so a
/// change that only shrinks the last tensor goes unseen.
///
/// `order` is the tensors' header order ([`Scan::tensors`]): each tensor must start where the
/// one before it in that order ends, as llama.cpp requires, so that two tensors of one size
/// with their offsets swapped are refused too. A name twice is refused. Without `order`, the
/// packing is checked in offset order.
pub(crate) fn tensor_layout(
    content: &gguf_file::Content,
    file_len: u64,
    order: Option<&[String]>,
) -> std::result::Result<(), String> {
    // As candle reads it: other types, and negative values, leave the default of 32.
    use gguf_file::Value as V;
    let alignment = match content.metadata.get("general.alignment") {
        Some(&V::U8(a)) => u64::from(a),
        Some(&V::U16(a)) => u64::from(a),
        Some(&V::U32(a)) => u64::from(a),
        Some(&V::I8(a)) => u64::try_from(a).unwrap_or(32),
        Some(&V::I16(a)) => u64::try_from(a).unwrap_or(32),
        Some(&V::I32(a)) => u64::try_from(a).unwrap_or(32),
        _ => 32,
    };
    if !alignment.is_power_of_two() {
        return Err(format!(
            "`general.alignment` is {alignment}; it must be a power of two"
        ));
    }
    let mut extents: Vec<(u64, u64, &str)> = Vec::with_capacity(content.tensor_infos.len());
    for (name, info) in &content.tensor_infos {
        let dims = info.shape.dims();
        let elems = dims
            .iter()
            .try_fold(1u64, |n, &d| n.checked_mul(d as u64))
            .ok_or_else(|| format!("tensor `{name}`: element count of {dims:?} overflows"))?;
        let block = info.ggml_dtype.block_size() as u64;
        let row = dims.last().copied().unwrap_or(1) as u64;
        if !row.is_multiple_of(block) {
            return Err(format!(
                "tensor `{name}`: rows of {row} elements are not whole {:?} blocks of {block}",
                info.ggml_dtype
            ));
        }
        let too_big = || {
            format!(
                "tensor `{name}`: {dims:?} {:?} ends past 2^64",
                info.ggml_dtype
            )
        };
        let bytes = (elems / block)
            .checked_mul(info.ggml_dtype.type_size() as u64)
            .ok_or_else(too_big)?;
        if !info.offset.is_multiple_of(alignment) {
            return Err(format!(
                "tensor `{name}`: data offset {} is not a multiple of the alignment {alignment}",
                info.offset
            ));
        }
        let start = content
            .tensor_data_offset
            .checked_add(info.offset)
            .ok_or_else(too_big)?;
        let end = start.checked_add(bytes).ok_or_else(too_big)?;
        if end > file_len {
            return Err(format!(
                "truncated: tensor `{name}` ends at byte {end}, file has {file_len} bytes"
            ));
        }
        extents.push((start, end, name));
    }
    // llama.cpp requires each tensor to start where the one before it ends, padded to the
    // alignment, in header order. candle keeps no order: the walk's is used, and where the
    // walk could not give it, the offsets' (every file llama.cpp loads passes either way;
    // in offset order a changed type, shape or offset still leaves a gap or an overlap).
    match order {
        Some(order) => {
            if order.len() != extents.len() {
                let mut seen = std::collections::HashSet::new();
                let twice = order.iter().find(|n| !seen.insert(n.as_str()));
                return Err(match twice {
                    Some(n) => format!("tensor `{n}` appears twice in the header"),
                    None => format!(
                        "the header lists {} tensors, {} of them by distinct names",
                        order.len(),
                        extents.len()
                    ),
                });
            }
            let rank: std::collections::HashMap<&str, usize> = order
                .iter()
                .enumerate()
                .map(|(i, n)| (n.as_str(), i))
                .collect();
            extents.sort_by_key(|e| rank.get(e.2).copied().unwrap_or(usize::MAX));
        }
        None => extents.sort_unstable(),
    }
    let mut expected = content.tensor_data_offset;
    let mut before: Option<&str> = None;
    for (start, end, name) in extents {
        if start != expected {
            let after = match before {
                Some(b) => format!("`{b}` ends (padded) at byte {expected}"),
                None => format!("tensor data starts at byte {expected}"),
            };
            return Err(format!(
                "tensor `{name}` starts at byte {start} but {after}: corrupt offsets, types or \
                 shapes"
            ));
        }
        expected = end.div_ceil(alignment).saturating_mul(alignment);
        before = Some(name);
    }
    Ok(())
}
