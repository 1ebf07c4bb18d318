//! Multi-turn chat that keeps the KV cache between turns (`Engine::chat_turn`, `keydiff chat`).

use std::io::Write;
use std::process::{Command, Stdio};

use keydiff::{
    CacheConfig, Conversation, Engine, EngineConfig, GenerateParams, Message, ModelSource,
    PolicyKind, Prompt,
};
use keydiff_tests::{keydiff_bin, model, SMOLLM2};

fn engine(cache: CacheConfig) -> Engine {
    let cfg = EngineConfig {
        cache,
        ..Default::default()
    };
    Engine::load(&ModelSource::Gguf(model(SMOLLM2)), &cfg).unwrap()
}

fn params(n: usize) -> GenerateParams {
    GenerateParams {
        max_tokens: n,
        ..Default::default()
    }
}

/// A fresh request on the conversation `before` and the user message `user`, with `p`.
fn fresh(e: &Engine, before: Vec<Message>, user: &str, p: &GenerateParams) -> keydiff::Output {
    let mut messages = before;
    messages.push(Message::new("user", user.to_string()));
    let params = GenerateParams {
        prompt: Prompt::Chat(messages),
        ..p.clone()
    };
    e.generate(&params, |_| {}).unwrap()
}

const TURNS: [&str; 3] = [
    "What is the capital of France? Answer in one word.",
    "And the capital of Italy?",
    "Name a famous painter from one of those two countries.",
];

/// With a full cache, each turn prefills only what the template adds, the cache grows as the
/// conversation does, and every reply is the one a fresh request on the whole conversation
/// gives: the same prompt tokens (the replies are fed as generated, not re-tokenized; here
/// they re-tokenize the same) and the same greedy tokens.
#[test]
fn turns_reuse_the_cache_and_match_fresh_requests() {
    let e = engine(CacheConfig::full(32));
    let system = "You are a helpful assistant.";
    let mut conv = Conversation::new(Some(system));
    let mut fed: Vec<u32> = Vec::new();
    let mut last_kv = 0;
    for (i, user) in TURNS.iter().enumerate() {
        let before = conv.messages().to_vec();
        let kept = conv.position();
        let out = e.chat_turn(&mut conv, user, &params(16), |_| {}).unwrap();
        assert_eq!(out.stats.prefix_tokens, kept, "turn {i}");
        assert!(!out.tokens.is_empty(), "turn {i}");
        // A fresh request on the whole conversation so far.
        let fresh = fresh(&e, before, user, &params(16));
        fed.extend(&out.prompt_tokens);
        assert_eq!(
            fed, fresh.prompt_tokens,
            "turn {i}: the cache holds other tokens"
        );
        assert_eq!(
            out.tokens, fresh.tokens,
            "turn {i}: {:?} vs {:?}",
            out.text, fresh.text
        );
        if i > 0 {
            assert!(
                out.prompt_tokens.len() < fresh.prompt_tokens.len() / 2,
                "turn {i}"
            );
            assert!(
                out.stats.peak_kv_bytes > last_kv,
                "turn {i}: the cache did not grow"
            );
        }
        last_kv = out.stats.peak_kv_bytes;
        // The reply is in the cache, but its last token only once the next turn feeds it.
        fed.extend(&out.tokens[..out.tokens.len() - 1]);
        assert_eq!(conv.position(), fed.len(), "turn {i}");
        fed.push(*out.tokens.last().unwrap());
        if out.stats.stop_reason == keydiff::StopReason::Eos {
            // The template writes the end-of-turn token itself: the next turn feeds it.
            fed.pop();
        }
    }
    assert_eq!(conv.messages().len(), 1 + 2 * TURNS.len());
    assert_eq!(conv.messages()[2].role, "assistant");
    assert!(
        conv.messages()[2].content.contains("Paris"),
        "{:?}",
        conv.messages()
    );
}

/// Penalties count the earlier turns as context, as in a fresh request on the whole
/// conversation (llama-cli's window reaches back into them): each turn's reply, under
/// llama.cpp's penalties over the whole context and under OpenAI's, is the fresh request's.
/// They used to see only the turn's new tokens.
#[test]
fn penalties_see_the_earlier_turns() {
    let e = engine(CacheConfig::full(32));
    for output_penalties in [false, true] {
        let sampling = keydiff::Sampling {
            presence_penalty: 1.5,
            frequency_penalty: 0.5,
            repetition_penalty: 1.3,
            repeat_last_n: usize::MAX,
            output_penalties,
            ..Default::default()
        };
        let p = GenerateParams {
            sampling,
            ..params(12)
        };
        let mut conv = Conversation::new(None);
        for (i, user) in ["Say hello.", "Say hello again."].iter().enumerate() {
            let before = conv.messages().to_vec();
            let out = e.chat_turn(&mut conv, user, &p, |_| {}).unwrap();
            let fresh = fresh(&e, before, user, &p);
            assert_eq!(
                out.tokens, fresh.tokens,
                "output_penalties {output_penalties}, turn {i}: {:?} vs {:?}",
                out.text, fresh.text
            );
        }
    }
}

/// A template that rewrites earlier turns, as Qwen 3's drops the reasoning of earlier replies:
/// each turn goes on from the tokens the cache and the re-rendered conversation have in
/// common (the cache is cut back to them), and its reply is still the one a fresh request on
/// the whole conversation gives. A grammar makes SmolLM2 reason before it answers.
#[test]
fn a_rewriting_template_keeps_the_tokens_in_common() {
    let template = "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' }}{%- if \
        m.role == 'assistant' %}{{- m.content.split('</think>')[-1].lstrip('\\n') }}{%- else \
        %}{{- m.content }}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}{{- \
        '<|im_start|>assistant\\n' }}";
    let cfg = EngineConfig {
        cache: CacheConfig::full(32),
        chat_template: Some(template.into()),
        ..Default::default()
    };
    let e = Engine::load(&ModelSource::Gguf(model(SMOLLM2)), &cfg).unwrap();
    let mut p = params(40);
    p.sampling.format = keydiff::Format::Grammar(
        "root ::= \"<think>\" [a-z ]{4,30} \"</think>\\n\\n\" [A-Z] [a-z ]{2,20} \".\"".into(),
    );
    let mut conv = Conversation::new(None);
    for (i, user) in TURNS.iter().enumerate() {
        let before = conv.messages().to_vec();
        let at = conv.position();
        let out = e.chat_turn(&mut conv, user, &p, |_| {}).unwrap();
        assert!(out.text.starts_with("<think>"), "turn {i}: {:?}", out.text);
        let fresh = fresh(&e, before, user, &p);
        let kept = out.stats.prefix_tokens;
        assert_eq!(
            out.prompt_tokens,
            fresh.prompt_tokens[kept..],
            "turn {i}: kept {kept}"
        );
        assert_eq!(out.tokens, fresh.tokens, "turn {i}");
        if i > 0 {
            // The last reply's reasoning is gone from the rendering: the cache is cut back
            // to before it, and keeps every earlier turn.
            assert!(0 < kept && kept < at, "turn {i}: kept {kept} of {at}");
        }
        eprintln!(
            "turn {i}: kept {kept} of {at} tokens, fed {}: {:?}",
            out.prompt_tokens.len(),
            out.text
        );
    }
}

/// Under a budget the conversation stays in N + B slots, whatever its length: turns start
/// after decode left up to N + K - 1 slots (the first chunk takes the room left), evict, and
/// go on; positions keep counting.
#[test]
fn a_budgeted_conversation_stays_in_its_slots() {
    let cache = CacheConfig {
        policy: PolicyKind::parse("keydiff", 32, 0).unwrap(),
        budget: Some(48),
        ..CacheConfig::full(16)
    };
    let e = engine(cache);
    let mut conv = Conversation::new(None);
    let mut kv = None;
    let mut evictions = 0;
    for user in TURNS.iter().chain(TURNS.iter()) {
        let out = e.chat_turn(&mut conv, user, &params(24), |_| {}).unwrap();
        assert!(conv.cache_len() <= 48 + 16, "{} slots", conv.cache_len());
        assert_eq!(
            *kv.get_or_insert(out.stats.peak_kv_bytes),
            out.stats.peak_kv_bytes
        );
        evictions += out.stats.eviction.evictions;
    }
    assert!(evictions > 0);
    assert!(
        conv.position() > 2 * (48 + 16),
        "position {}",
        conv.position()
    );
}

/// Runs `keydiff chat` on SmolLM2 (16 tokens a reply) with `args`, `input` on stdin;
/// checks that it succeeded and returns its stdout and stderr.
fn chat_cli(args: &[&str], input: &[u8]) -> (String, String) {
    let (ok, so, se) = chat_cli_status(args, input);
    assert!(ok, "{se}");
    (so, se)
}

/// [`chat_cli`] that may fail: whether it succeeded, its stdout and stderr.
fn chat_cli_status(args: &[&str], input: &[u8]) -> (bool, String, String) {
    let mut child = Command::new(keydiff_bin())
        .args(["chat", "-m", model(SMOLLM2).to_str().unwrap(), "-n", "16"])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(input).unwrap();
    let out = child.wait_with_output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

/// The `reused` counts (earlier tokens not prefilled again) of each turn's stats line.
fn kept(stderr: &str) -> Vec<usize> {
    stderr
        .lines()
        .filter_map(|l| l.split(" reused)").next()?.rsplit('(').next()?.parse().ok())
        .collect()
}

/// A line ending in `\` goes on to the next (llama-cli's multi-line input); bytes that are not
/// UTF-8 are replaced, not the end of the chat; `/clear` starts a new conversation and `/exit`
/// ends it (what follows is not read).
#[test]
fn chat_command_reads_continued_lines_and_commands() {
    let (so, se) = chat_cli(
        &[],
        b"What is the capital\\\nof France?\n/clear\nAnd the capital of \xffItaly?\n/exit\n\
          Never read.\n",
    );
    let replies: Vec<&str> = so.lines().filter(|l| !l.is_empty()).collect();
    assert_eq!(kept(&se), [0, 0], "{se}");
    assert!(replies.len() >= 2, "{so}");
    assert!(so.contains("Paris"), "{so}");
    assert!(
        se.contains("[a new conversation]") && se.contains("not UTF-8"),
        "{se}"
    );
    assert_eq!(se.matches("[turn:").count(), 2, "{se}");
}

/// A message the context cannot hold fails alone, as a server's request does: the chat goes
/// on (here after `/clear`), and the exit status says a message failed.
#[test]
fn chat_command_goes_on_after_a_message_that_does_not_fit() {
    let long = "Tell me more about it. ".repeat(30);
    let q = "What is the capital of France?";
    let input = format!("{q}\n{long}\n/clear\n{q}\n");
    let (ok, so, se) = chat_cli_status(&["-c", "120"], input.as_bytes());
    assert!(!ok, "{se}");
    assert!(
        se.contains("beyond") && se.contains("/clear starts a new one"),
        "{se}"
    );
    assert!(se.contains("1 message(s) failed"), "{se}");
    assert_eq!(se.matches("[turn:").count(), 2, "{se}");
    assert_eq!(so.matches("Paris").count(), 2, "{so}");
}

#[test]
fn chat_command_answers_each_line() {
    let (so, se) = chat_cli(&[], b"What is the capital of France?\n\nAnd of Italy?\n");
    let replies: Vec<&str> = so.lines().collect();
    assert_eq!(replies.len(), 2, "{so}");
    assert!(replies[0].contains("Paris"), "{so}");
    assert!(replies[1].contains("Rome"), "{so}");
    // The blank line is skipped; the second turn kept the first one's tokens.
    let kept = kept(&se);
    assert_eq!(kept.len(), 2, "{se}");
    assert!(kept[0] == 0 && kept[1] > 30, "{se}");
}

/// `chat --stop`: a reply ends at the stop string, which is not printed; the conversation
/// goes on.
#[test]
fn chat_command_stops_at_a_stop_string() {
    let (so, se) = chat_cli(
        &["--stop", "Paris"],
        b"What is the capital of France?\nAnd of Italy?\n",
    );
    let replies: Vec<&str> = so.lines().collect();
    assert_eq!(replies.len(), 2, "{so}");
    assert!(!so.contains("Paris"), "{so}");
    assert!(replies[1].contains("Rome"), "{so}");
    let stops: Vec<&str> = se
        .lines()
        .filter_map(|l| l.split("stop: ").nth(1))
        .collect();
    assert_eq!(stops[0], "StopString]", "{se}");
}
