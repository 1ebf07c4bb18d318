//! Embedding keydiff: load a GGUF model, stream a chat answer, print the stats.
//!
//! cargo run --release -p keydiff --example generate -- models/SmolLM2-135M-Instruct.Q4_1.gguf

use keydiff::{Engine, EngineConfig, Event, GenerateParams, Message, ModelSource, Prompt};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "models/SmolLM2-135M-Instruct.Q4_1.gguf".into());
    let engine = Engine::load(&ModelSource::parse(&path)?, &EngineConfig::default())?;
    let params = GenerateParams {
        prompt: Prompt::Chat(vec![Message::new("user", "Name three primary colors.")]),
        max_tokens: 48,
        ..Default::default()
    };
    let out = engine.generate(&params, |ev| {
        if let Event::Text(t) = ev {
            print!("{t}");
        }
    })?;
    println!("\n{:#?}", out.stats);
    Ok(())
}
