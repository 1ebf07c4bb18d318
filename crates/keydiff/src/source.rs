//! Where a model comes from: a GGUF file, an HF directory, a hub id, or a random-weight preset.

use std::path::{Path, PathBuf};

use candle_core::quantized::GgmlDType;

use crate::error::{EngineError, Result};

/// A model location, as given on the command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    /// A `.gguf` file.
    Gguf(PathBuf),
    /// A directory with config.json, safetensors and tokenizer.json.
    HfDir(PathBuf),
    /// A Hugging Face hub repository (`org/name`), or one GGUF file in it (`org/name:file.gguf`).
    Hub { repo: String, file: Option<String> },
    /// A preset shape (HF config.json, e.g. `configs/llama-3.2-3b.json`) with seeded random
    /// weights, drawn on the device, or on the host when `on_host` (same values on every device).
    Random {
        config: PathBuf,
        seed: u64,
        on_host: bool,
        /// Linears and the embedding quantized to this GGML type (Q4_K, Q8_0, ...: what a
        /// GGUF file of that type holds, run by the same quantized matmuls), on the host, of
        /// values drawn as `on_host` says. `None`: dense in the engine's dtype.
        weights: Option<GgmlDType>,
    },
}

impl ModelSource {
    /// Interprets a `-m` argument: an existing path first, else `org/name[:file.gguf]` on the hub.
    pub fn parse(s: &str) -> Result<Self> {
        let p = Path::new(s);
        if p.is_dir() {
            return Ok(ModelSource::HfDir(p.to_path_buf()));
        }
        if p.is_file() {
            // One file of an HF checkpoint: the model is its directory.
            let hf_file = p
                .extension()
                .is_some_and(|e| e == "safetensors" || e == "json");
            if hf_file {
                let dir = p.parent().filter(|d| !d.as_os_str().is_empty());
                return Err(EngineError::BadParams(format!(
                    "{s} is a file of a Hugging Face checkpoint: give its directory ({}), which \
                     holds config.json, the safetensors and tokenizer.json",
                    dir.map_or(".".into(), |d| d.display().to_string())
                )));
            }
            return Ok(ModelSource::Gguf(p.to_path_buf()));
        }
        let (repo, file) = match s.split_once(':') {
            Some((r, f)) => (r, Some(f.to_string())),
            None => (s, None),
        };
        let parts: Vec<&str> = repo.split('/').collect();
        let hub_like = parts.len() == 2
            && parts.iter().all(|x| !x.is_empty() && !x.starts_with('.'))
            && !repo.ends_with(".gguf");
        if hub_like {
            return Ok(ModelSource::Hub {
                repo: repo.to_string(),
                file,
            });
        }
        if s.ends_with(".gguf") {
            // A missing .gguf path is reported by the loader, naming the file.
            return Ok(ModelSource::Gguf(p.to_path_buf()));
        }
        Err(EngineError::Model(keydiff_model::ModelError::NotFound(
            p.to_path_buf(),
        )))
    }

    /// Resolves a hub source to local files through hf-hub's cache (downloading when online).
    pub(crate) fn resolve_hub(repo: &str, file: Option<&str>) -> Result<ModelSource> {
        let api = hf_hub::api::sync::ApiBuilder::from_env()
            .with_progress(false)
            .build()
            .map_err(|e| EngineError::Hub(e.to_string()))?;
        let r = api.model(repo.to_string());
        let get = |name: &str| -> Result<PathBuf> {
            r.get(name).map_err(|e| {
                EngineError::Hub(format!(
                    "`{repo}` is no local file or directory, and as a hub id: cannot fetch \
                     `{name}`: {e} (offline? pass a local path to -m)"
                ))
            })
        };
        if let Some(f) = file {
            return Ok(ModelSource::Gguf(get(f)?));
        }
        let config = get("config.json")?;
        let dir = config.parent().map(Path::to_path_buf).unwrap_or_default();
        for f in ["tokenizer.json", "tokenizer_config.json"] {
            get(f)?;
        }
        // Optional files; the chat template where transformers 4.50 and later save it.
        for f in [
            "generation_config.json",
            "chat_template.jinja",
            "chat_template.json",
        ] {
            let _ = get(f);
        }
        match get("model.safetensors.index.json") {
            Ok(index) => {
                let text = std::fs::read_to_string(&index)
                    .map_err(|e| EngineError::Hub(format!("{}: {e}", index.display())))?;
                let v: serde_json::Value = serde_json::from_str(&text)
                    .map_err(|e| EngineError::Hub(format!("{}: {e}", index.display())))?;
                let mut files: Vec<String> = v["weight_map"]
                    .as_object()
                    .map(|m| {
                        m.values()
                            .filter_map(|x| x.as_str().map(String::from))
                            .collect()
                    })
                    .unwrap_or_default();
                files.sort();
                files.dedup();
                for f in files {
                    // Shards are files of the repository: no absolute path, no `..` (checked
                    // before fetching, as the loader checks a local index).
                    let inside = !f.is_empty()
                        && Path::new(&f)
                            .components()
                            .all(|c| matches!(c, std::path::Component::Normal(_)));
                    if !inside {
                        return Err(EngineError::Hub(format!(
                            "{}: `weight_map` names `{f}`, which is not a file of `{repo}`",
                            index.display()
                        )));
                    }
                    get(&f)?;
                }
            }
            Err(_) => {
                get("model.safetensors")?;
            }
        }
        Ok(ModelSource::HfDir(dir))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_forms() {
        assert_eq!(
            ModelSource::parse("Qwen/Qwen2.5-0.5B").unwrap(),
            ModelSource::Hub {
                repo: "Qwen/Qwen2.5-0.5B".into(),
                file: None
            }
        );
        assert_eq!(
            ModelSource::parse("org/repo:model-q4.gguf").unwrap(),
            ModelSource::Hub {
                repo: "org/repo".into(),
                file: Some("model-q4.gguf".into())
            }
        );
        assert!(matches!(
            ModelSource::parse("missing.gguf").unwrap(),
            ModelSource::Gguf(_)
        ));
        assert!(ModelSource::parse("no-such-thing").is_err());
    }
}
