//! Grammar-constrained generation: llama.cpp's GBNF grammars (`--grammar`, the server's
//! `grammar`), and what JSON schemas compile to ([`crate::json_schema`]).
//!
//! A grammar is rules of the form `name ::= alternatives`, starting from `root`:
//!
//! ```text
//! root   ::= answer ws "." | "unsure"
//! answer ::= "yes" | "no"        # a comment
//! ws     ::= [ \t]*
//! ```
//!
//! Elements are `"literals"`, character classes `[a-z0-9_]` and `[^"\\]`, `.` (any character),
//! rule names and `( groups )`, each followed by `*`, `+`, `?`, `{m}`, `{m,}` or `{m,n}` as
//! in llama.cpp's grammars. Literals and classes take the escapes `\n \r \t \\ \" \[ \]` and
//! `\xHH \uHHHH \UHHHHHHHH`. A rule goes on over lines after `::=`, after `|` and inside
//! parentheses. A repetition repeats the whole symbol before it (a literal, not its last
//! character). Undefined rules, a missing `root`, left recursion, repeating what can match the
//! empty text, groups nested over [`MAX_NESTING`] deep and repetitions written out to over
//! [`MAX_ELEMENTS`] elements are refused when the grammar is parsed.
//!
//! [`GrammarState`] follows the text generated so far, as llama.cpp's grammar sampler does:
//! every way the grammar can be at is a stack of rule positions (shared between the ways, so a
//! copy is cheap), each stack's top the character class the next character must be in. Before
//! each token is sampled, [`GrammarState::mask`] sets the logits of the tokens that cannot
//! come next to −∞, walking the vocabulary sorted by bytes so that tokens sharing a prefix
//! are checked once for it; the states the walk meets are interned, so that each (state,
//! byte) is stepped once and then looked up, and the last few masks are kept by state, for
//! a reply that comes back to one. Characters are the UTF-8 text's code points; a token may end
//! inside one, as long as some allowed character starts that way.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// A grammar refused: what is wrong, and where.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("grammar: {0}")]
pub struct GrammarError(pub String);

/// `{m,n}` repetitions allowed at most.
pub const MAX_REPEAT: u32 = 65_536;

/// Elements the rules may hold in all, once repetitions are written out.
pub const MAX_ELEMENTS: usize = 1 << 21;

/// Groups nested at most.
pub const MAX_NESTING: usize = 256;

/// Ways to read the text at once (stacks) at most; a grammar that needs more is refused as
/// too ambiguous when it gets there ([`GrammarState::is_ambiguous`]).
pub const MAX_STACKS: usize = 16_384;

/// One element of a sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Elem {
    /// One character in (or, when `negated`, outside) these inclusive code point ranges.
    Chars {
        ranges: Arc<[(u32, u32)]>,
        negated: bool,
    },
    /// A rule by index.
    Rule(usize),
}

impl Elem {
    fn matches(ranges: &[(u32, u32)], negated: bool, c: u32) -> bool {
        ranges.iter().any(|&(lo, hi)| lo <= c && c <= hi) != negated
    }
}

/// A parsed grammar: rule → alternatives → sequence of elements.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grammar {
    rules: Vec<Vec<Vec<Elem>>>,
    names: Vec<String>,
    root: usize,
}

impl Grammar {
    /// Parses GBNF text (see the module docs).
    pub fn parse(src: &str) -> Result<Grammar, GrammarError> {
        let mut p = Parser {
            src,
            pos: 0,
            ids: HashMap::new(),
            rules: Vec::new(),
            names: Vec::new(),
            used_at: Vec::new(),
            groups: 0,
            elements: 0,
            repeated: Vec::new(),
        };
        p.grammar()?;
        let Parser {
            rules,
            names,
            used_at,
            ids,
            repeated,
            ..
        } = p;
        let mut defined = Vec::with_capacity(rules.len());
        for (i, r) in rules.into_iter().enumerate() {
            match r {
                Some(r) => defined.push(r),
                None => {
                    return Err(GrammarError(format!(
                        "rule `{}` is used (line {}) but not defined",
                        names[i],
                        line_at(src, used_at[i])
                    )))
                }
            }
        }
        let root = *ids
            .get("root")
            .ok_or_else(|| GrammarError("no rule named `root`, where the text starts".into()))?;
        let g = Grammar {
            rules: defined,
            names,
            root,
        };
        // Repeating what can match the empty text more than once gives as many ways to read
        // each text as there are copies, and, where a copy can be empty in more than one way,
        // ways that multiply with the copies (`("a"? | "b"?){64}`: 2^64), which the
        // recognizer would follow one by one: refused.
        let null = g.nullable();
        for (e, min, max, at) in repeated {
            if matches!(e, Elem::Rule(r) if null[r]) && max.is_none_or(|m| m > 1) {
                let op = match (min, max) {
                    (0, None) => "*".to_string(),
                    (1, None) => "+".to_string(),
                    (n, None) => format!("{{{n},}}"),
                    (n, Some(m)) if n == m => format!("{{{n}}}"),
                    (n, Some(m)) => format!("{{{n},{m}}}"),
                };
                return Err(GrammarError(format!(
                    "line {}: repeating (`{op}`) something that can match the empty text is \
                     ambiguous (`( [x]* )*`); make the repeated part non-empty (`[x]*`), or \
                     optional once",
                    line_at(src, at)
                )));
            }
        }
        g.check_left_recursion()?;
        Ok(g)
    }

    /// The rules that can match the empty text.
    fn nullable(&self) -> Vec<bool> {
        let mut null = vec![false; self.rules.len()];
        loop {
            let mut changed = false;
            for (r, alts) in self.rules.iter().enumerate() {
                if !null[r]
                    && alts
                        .iter()
                        .any(|seq| seq.iter().all(|e| matches!(e, Elem::Rule(x) if null[*x])))
                {
                    null[r] = true;
                    changed = true;
                }
            }
            if !changed {
                return null;
            }
        }
    }

    /// Refuses a rule that can reach itself before reading a character: following the text
    /// would never end.
    fn check_left_recursion(&self) -> Result<(), GrammarError> {
        let null = self.nullable();
        // The rules each rule can start with.
        let first: Vec<Vec<usize>> = (self.rules.iter())
            .map(|alts| {
                let mut out = Vec::new();
                for seq in alts {
                    for e in seq {
                        match e {
                            Elem::Rule(x) => {
                                out.push(*x);
                                if !null[*x] {
                                    break;
                                }
                            }
                            Elem::Chars { .. } => break,
                        }
                    }
                }
                out
            })
            .collect();
        // Depth-first search for a cycle, with its own stack (a grammar can chain many
        // rules): 0 unseen, 1 on the path, 2 done. `path` holds (rule, next edge).
        let mut mark = vec![0u8; self.rules.len()];
        for start in 0..self.rules.len() {
            if mark[start] != 0 {
                continue;
            }
            let mut path: Vec<(usize, usize)> = vec![(start, 0)];
            mark[start] = 1;
            while let Some(&mut (r, ref mut edge)) = path.last_mut() {
                let Some(&x) = first[r].get(*edge) else {
                    mark[r] = 2;
                    path.pop();
                    continue;
                };
                *edge += 1;
                match mark[x] {
                    0 => {
                        mark[x] = 1;
                        path.push((x, 0));
                    }
                    1 => {
                        let at = path.iter().position(|p| p.0 == x).expect("on the path");
                        let mut names: Vec<&str> = path[at..]
                            .iter()
                            .map(|p| self.names[p.0].as_str())
                            .collect();
                        names.push(&self.names[x]);
                        return Err(GrammarError(format!(
                            "rule `{}` is left-recursive ({}): it can reach itself before \
                             reading a character",
                            names[0],
                            names.join(" → ")
                        )));
                    }
                    _ => {}
                }
            }
        }
        Ok(())
    }

    fn elem(&self, f: &Frame) -> &Elem {
        &self.rules[f.rule as usize][f.alt as usize][f.pos as usize]
    }

    /// The stack after the element `f` points at.
    fn next(&self, f: &Frame) -> Stack {
        let seq = &self.rules[f.rule as usize][f.alt as usize];
        if f.pos as usize + 1 < seq.len() {
            Some(Arc::new(Frame {
                pos: f.pos + 1,
                parent: f.parent.clone(),
                ..*f
            }))
        } else {
            f.parent.clone()
        }
    }

    /// Pushes onto `out` the stacks `stack` becomes once its rule references are expanded,
    /// so that each one's top is a character class (or it is empty: the text is complete).
    /// It ends, as the grammar has no left recursion; it keeps its own list of stacks to
    /// expand rather than recursing, so that a deep grammar or a long text of nested empty
    /// endings cannot overflow the thread's stack.
    ///
    /// False, having stopped, when `out` would hold more than [`MAX_STACKS`] stacks.
    fn expand(&self, stack: Stack, out: &mut StackSet) -> bool {
        let mut todo = vec![stack];
        while let Some(stack) = todo.pop() {
            if out.len() > MAX_STACKS {
                return false;
            }
            let Some(f) = &stack else {
                out.insert(None);
                continue;
            };
            match self.elem(f) {
                Elem::Chars { .. } => out.insert(stack),
                Elem::Rule(r) => {
                    let rest = self.next(f);
                    self.push_rule(*r, rest, &mut todo);
                }
            }
        }
        out.len() <= MAX_STACKS
    }

    fn expand_rule(&self, r: usize, rest: Stack, out: &mut StackSet) -> bool {
        let mut todo = Vec::new();
        self.push_rule(r, rest, &mut todo);
        todo.into_iter().rev().all(|s| self.expand(s, out))
    }

    /// Pushes rule `r`'s alternatives onto `todo`, the last first (so that they come out in
    /// order), each over `rest`.
    fn push_rule(&self, r: usize, rest: Stack, todo: &mut Vec<Stack>) {
        for (alt, seq) in self.rules[r].iter().enumerate().rev() {
            if seq.is_empty() {
                todo.push(rest.clone());
            } else {
                todo.push(Some(Arc::new(Frame {
                    rule: r as u32,
                    alt: alt as u32,
                    pos: 0,
                    parent: rest.clone(),
                })));
            }
        }
    }
}

/// A position in a sequence, and the stack below it (where its rule was referenced from,
/// already moved past the reference).
#[derive(Debug)]
struct Frame {
    rule: u32,
    alt: u32,
    pos: u32,
    parent: Stack,
}

type Stack = Option<Arc<Frame>>;

impl Drop for Frame {
    /// Frees a long stack frame by frame, rather than by a recursion as deep as the stack.
    fn drop(&mut self) {
        let mut below = self.parent.take();
        while let Some(f) = below {
            match Arc::try_unwrap(f) {
                Ok(mut f) => below = f.parent.take(),
                Err(_) => break,
            }
        }
    }
}

fn same(mut a: &Stack, mut b: &Stack) -> bool {
    loop {
        match (a, b) {
            (None, None) => return true,
            (Some(x), Some(y)) => {
                if Arc::ptr_eq(x, y) {
                    return true;
                }
                if (x.rule, x.alt, x.pos) != (y.rule, y.alt, y.pos) {
                    return false;
                }
                a = &x.parent;
                b = &y.parent;
            }
            _ => return false,
        }
    }
}

/// Stacks without repeats: a few compared one by one, more through their hashes.
#[derive(Default)]
struct StackSet {
    stacks: Vec<Stack>,
    /// Stack indices by hash, once there are more than [`LINEAR`].
    by_hash: HashMap<u64, Vec<u32>>,
}

const LINEAR: usize = 16;

impl StackSet {
    fn len(&self) -> usize {
        self.stacks.len()
    }

    fn insert(&mut self, s: Stack) {
        if self.stacks.len() < LINEAR {
            if !self.stacks.iter().any(|o| same(o, &s)) {
                self.stacks.push(s);
            }
            return;
        }
        if self.by_hash.is_empty() {
            for (i, o) in self.stacks.iter().enumerate() {
                self.by_hash.entry(hash(o)).or_default().push(i as u32);
            }
        }
        let bucket = self.by_hash.entry(hash(&s)).or_default();
        if !bucket.iter().any(|&i| same(&self.stacks[i as usize], &s)) {
            bucket.push(self.stacks.len() as u32);
            self.stacks.push(s);
        }
    }
}

/// A hash of a stack's frames.
fn hash(mut s: &Stack) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    while let Some(f) = s {
        (f.rule, f.alt, f.pos).hash(&mut h);
        s = &f.parent;
    }
    h.finish()
}

/// Where a grammar is in the text read so far (see the module docs). Cloning it is cheap:
/// the stacks are shared.
#[derive(Debug, Clone)]
pub struct GrammarState {
    grammar: Arc<Grammar>,
    stacks: Vec<Stack>,
    /// A UTF-8 character begun: its bits so far, how many bytes are still to come, and the
    /// least code point its length may encode (shorter, overlong forms are not UTF-8).
    partial: (u32, u8, u32),
    /// What the copies of a state share.
    shared: Arc<Shared>,
}

#[derive(Debug, Default)]
struct Shared {
    /// Masks computed for states of this grammar.
    masks: Mutex<MaskCache>,
    /// Some copy needed more than [`MAX_STACKS`] stacks.
    ambiguous: AtomicBool,
}

/// The last few masks computed, by vocabulary and state: a reply often comes back to a state
/// (inside a string, after each ordinary character), whose mask is then a copy.
#[derive(Debug, Default)]
struct MaskCache {
    /// (key, allowed tokens as bits).
    entries: VecDeque<(Vec<usize>, Vec<u64>)>,
}

/// Masks kept per request: at most this many vocabulary bitsets (19 KB each for 151 936
/// tokens).
const MASKS_KEPT: usize = 16;

impl GrammarState {
    /// Nothing read yet.
    pub fn new(grammar: Arc<Grammar>) -> Self {
        let mut stacks = StackSet::default();
        let fits = grammar.expand_rule(grammar.root, None, &mut stacks);
        let s = Self {
            grammar,
            stacks: stacks.stacks,
            partial: (0, 0, 0),
            shared: Arc::default(),
        };
        s.shared.ambiguous.store(!fits, Ordering::Relaxed);
        s
    }

    /// True once this state or a copy of it (one the mask tried) needed more than
    /// [`MAX_STACKS`] ways to read the text at once: what it then refused may have been
    /// allowed.
    pub fn is_ambiguous(&self) -> bool {
        self.shared.ambiguous.load(Ordering::Relaxed)
    }

    /// True when the text read so far is whole: the grammar's `root` matches all of it.
    pub fn is_done(&self) -> bool {
        self.partial.1 == 0 && self.stacks.iter().any(Option::is_none)
    }

    /// Reads `bytes`; false when the grammar allows no text that starts with what has been read
    /// (the state is then in no meaningful state).
    pub fn push_all(&mut self, bytes: &[u8]) -> bool {
        bytes.iter().all(|&b| self.push(b))
    }

    /// Reads one byte of UTF-8 text; false when the grammar allows no text that starts with
    /// what has been read.
    pub fn push(&mut self, b: u8) -> bool {
        let (bits, left, least) = self.partial;
        let c = if left == 0 {
            let (bits, left, least) = match b {
                0..=0x7f => return self.accept(b as u32),
                0xc0..=0xdf => (b as u32 & 0x1f, 1, 0x80),
                0xe0..=0xef => (b as u32 & 0x0f, 2, 0x800),
                0xf0..=0xf7 => (b as u32 & 0x07, 3, 0x1_0000),
                _ => return false,
            };
            self.partial = (bits, left, least);
            return self.can_start();
        } else {
            if b & 0xc0 != 0x80 {
                return false;
            }
            let bits = bits << 6 | (b as u32 & 0x3f);
            if left > 1 {
                self.partial = (bits, left - 1, least);
                return self.can_start();
            }
            self.partial = (0, 0, 0);
            if bits < least || char::from_u32(bits).is_none() {
                // Overlong, a surrogate, or beyond U+10FFFF.
                return false;
            }
            bits
        };
        self.accept(c)
    }

    /// Whether some stack's next character can start with the partial character read.
    fn can_start(&self) -> bool {
        let (bits, left, least) = self.partial;
        let shift = 6 * left as u32;
        let lo = (bits << shift).max(least);
        let hi = (bits << shift | ((1 << shift) - 1)).min(char::MAX as u32);
        // No character lies there, or only surrogates.
        if lo > hi || (0xd800 <= lo && hi <= 0xdfff) {
            return false;
        }
        self.stacks
            .iter()
            .flatten()
            .any(|f| match self.grammar.elem(f) {
                Elem::Chars { ranges, negated } => match negated {
                    true => !covers(ranges, lo, hi),
                    false => ranges.iter().any(|&(a, b)| a <= hi && lo <= b),
                },
                Elem::Rule(_) => unreachable!("stacks are expanded"),
            })
    }

    fn accept(&mut self, c: u32) -> bool {
        let mut out = StackSet::default();
        for f in self.stacks.iter().flatten() {
            if let Elem::Chars { ranges, negated } = self.grammar.elem(f) {
                if Elem::matches(ranges, *negated, c)
                    && !self.grammar.expand(self.grammar.next(f), &mut out)
                {
                    self.shared.ambiguous.store(true, Ordering::Relaxed);
                    self.stacks.clear();
                    return false;
                }
            }
        }
        self.stacks = out.stacks;
        !self.stacks.is_empty()
    }

    /// Sets to −∞ the logits of the tokens that cannot come next: tokens whose bytes would
    /// leave the grammar, tokens with no text (special tokens), and the end-of-generation
    /// tokens `eos` unless the text is whole. `tokens[id]` is token `id`'s bytes, `by_bytes`
    /// the ids of the tokens with text sorted by their bytes ([`sorted_by_bytes`]). Returns how
    /// many tokens are left.
    pub fn mask(
        &self,
        logits: &mut [f32],
        tokens: &[Box<[u8]>],
        by_bytes: &[u32],
        eos: &[u32],
    ) -> usize {
        // The vocabulary by where its slices are, then the state.
        let mut key = vec![
            tokens.as_ptr() as usize,
            tokens.len(),
            by_bytes.as_ptr() as usize,
            by_bytes.len(),
            eos.as_ptr() as usize,
            eos.len(),
            logits.len(),
        ];
        key.extend(self.key().into_iter().map(|k| k as usize));
        let cached = {
            let masks = self.shared.masks.lock().unwrap_or_else(|e| e.into_inner());
            masks
                .entries
                .iter()
                .find(|e| e.0 == key)
                .map(|e| e.1.clone())
        };
        let bits = match cached {
            Some(bits) => bits,
            None => {
                let mut ok = vec![false; logits.len()];
                Memo::new(self).walk(0, by_bytes, tokens, 0, &mut ok);
                let done = self.is_done();
                for &e in eos {
                    if let Some(o) = ok.get_mut(e as usize) {
                        *o = done;
                    }
                }
                let mut bits = vec![0u64; logits.len().div_ceil(64)];
                for (i, _) in ok.iter().enumerate().filter(|(_, ok)| **ok) {
                    bits[i / 64] |= 1 << (i % 64);
                }
                let mut masks = self.shared.masks.lock().unwrap_or_else(|e| e.into_inner());
                if masks.entries.len() == MASKS_KEPT {
                    masks.entries.pop_front();
                }
                masks.entries.push_back((key, bits.clone()));
                bits
            }
        };
        let mut left = 0;
        for (i, l) in logits.iter_mut().enumerate() {
            if bits[i / 64] >> (i % 64) & 1 == 1 {
                left += 1;
            } else {
                *l = f32::NEG_INFINITY;
            }
        }
        left
    }

    /// What identifies the state: its partial character and its stacks, frame by frame.
    fn key(&self) -> Vec<u32> {
        let (bits, left, least) = self.partial;
        let mut k = vec![bits, left as u32, least];
        for s in &self.stacks {
            let mut f = s;
            while let Some(x) = f {
                k.extend([x.rule, x.alt, x.pos]);
                f = &x.parent;
            }
            k.push(u32::MAX);
        }
        k
    }
}

/// The states one mask meets, each once, with the transitions found between them: inside a
/// string, say, every ordinary character leads back to the same state, so the walk over the
/// vocabulary steps each (state, byte) once and then looks it up.
struct Memo {
    states: Vec<GrammarState>,
    ids: HashMap<Vec<u32>, u32>,
    /// Each state's transitions found: the byte and [`DEAD`] or the state it leads to.
    next: Vec<Row>,
}

/// A state's transitions: a short list while it has few (most states of a grammar that
/// tells many prefixes apart), a table of all 256 bytes ([`UNSEEN`] for those not stepped
/// yet) once it has more than [`FEW`].
enum Row {
    Few(Vec<(u8, u32)>),
    All(Box<[u32; 256]>),
}

const FEW: usize = 16;
const UNSEEN: u32 = u32::MAX;
const DEAD: u32 = u32::MAX - 1;

impl Row {
    fn get(&self, b: u8) -> Option<u32> {
        match self {
            Row::Few(v) => v.iter().find(|e| e.0 == b).map(|e| e.1),
            Row::All(t) => Some(t[b as usize]).filter(|&to| to != UNSEEN),
        }
    }

    fn set(&mut self, b: u8, to: u32) {
        match self {
            Row::Few(v) if v.len() < FEW => v.push((b, to)),
            Row::Few(v) => {
                let mut t = Box::new([UNSEEN; 256]);
                for &(b, to) in v.iter() {
                    t[b as usize] = to;
                }
                t[b as usize] = to;
                *self = Row::All(t);
            }
            Row::All(t) => t[b as usize] = to,
        }
    }
}

impl Memo {
    fn new(start: &GrammarState) -> Self {
        let mut m = Memo {
            states: Vec::new(),
            ids: HashMap::new(),
            next: Vec::new(),
        };
        m.intern(start.clone());
        m
    }

    fn intern(&mut self, s: GrammarState) -> u32 {
        let key = s.key();
        if let Some(&id) = self.ids.get(&key) {
            return id;
        }
        let id = self.states.len() as u32;
        self.states.push(s);
        self.ids.insert(key, id);
        self.next.push(Row::Few(Vec::new()));
        id
    }

    /// The state after byte `b` from state `id`; `None` when the grammar refuses it.
    fn step(&mut self, id: u32, b: u8) -> Option<u32> {
        let to = match self.next[id as usize].get(b) {
            Some(to) => to,
            None => {
                let mut s = self.states[id as usize].clone();
                let to = if s.push(b) { self.intern(s) } else { DEAD };
                self.next[id as usize].set(b, to);
                to
            }
        };
        (to != DEAD).then_some(to)
    }

    /// Marks the tokens in `ids` that state `state` accepts; they share their first `depth`
    /// bytes, which it has read.
    fn walk(
        &mut self,
        state: u32,
        ids: &[u32],
        tokens: &[Box<[u8]>],
        depth: usize,
        ok: &mut [bool],
    ) {
        let mut i = 0;
        // Sorted by bytes, the tokens that end here come first.
        while i < ids.len() && tokens[ids[i] as usize].len() == depth {
            if let Some(o) = ok.get_mut(ids[i] as usize) {
                *o = true;
            }
            i += 1;
        }
        while i < ids.len() {
            let b = tokens[ids[i] as usize][depth];
            let end = i + ids[i..].partition_point(|&t| tokens[t as usize][depth] == b);
            if let Some(next) = self.step(state, b) {
                self.walk(next, &ids[i..end], tokens, depth + 1, ok);
            }
            i = end;
        }
    }
}

/// Whether `ranges` together cover every code point from `lo` to `hi`.
fn covers(ranges: &[(u32, u32)], lo: u32, hi: u32) -> bool {
    let mut x = lo;
    loop {
        match ranges.iter().find(|&&(a, b)| a <= x && x <= b) {
            Some(&(_, b)) if b >= hi => return true,
            Some(&(_, b)) => x = b + 1,
            None => return false,
        }
    }
}

/// The ids of the tokens with text (`tokens[id]` not empty), sorted by their bytes: what
/// [`GrammarState::mask`] walks.
pub fn sorted_by_bytes(tokens: &[Box<[u8]>]) -> Vec<u32> {
    let mut ids: Vec<u32> = (0..tokens.len() as u32)
        .filter(|&t| !tokens[t as usize].is_empty())
        .collect();
    ids.sort_by(|&a, &b| tokens[a as usize].cmp(&tokens[b as usize]));
    ids
}

/// The line of byte `pos` of `src`, from 1.
fn line_at(src: &str, pos: usize) -> usize {
    src[..pos].matches('\n').count() + 1
}

struct Parser<'a> {
    src: &'a str,
    pos: usize,
    ids: HashMap<String, usize>,
    /// `None` until defined.
    rules: Vec<Option<Vec<Vec<Elem>>>>,
    names: Vec<String>,
    /// Where (a byte of the source) each rule was first used or defined.
    used_at: Vec<usize>,
    /// Groups open.
    groups: usize,
    /// Elements written out by repetitions so far.
    elements: usize,
    /// Each repetition: what, min, max, and where it ends (for errors).
    repeated: Vec<(Elem, u32, Option<u32>, usize)>,
}

impl Parser<'_> {
    fn line(&self) -> usize {
        line_at(self.src, self.pos)
    }

    fn err<T>(&self, what: impl std::fmt::Display) -> Result<T, GrammarError> {
        Err(GrammarError(format!("line {}: {what}", self.line())))
    }

    fn peek(&self) -> Option<char> {
        self.src[self.pos..].chars().next()
    }

    fn bump(&mut self) -> Option<char> {
        let c = self.peek()?;
        self.pos += c.len_utf8();
        Some(c)
    }

    /// Spaces, tabs and comments; newlines too when `newlines`.
    fn space(&mut self, newlines: bool) {
        while let Some(c) = self.peek() {
            match c {
                ' ' | '\t' => self.pos += 1,
                '\r' | '\n' if newlines => self.pos += 1,
                '#' => {
                    let rest = &self.src[self.pos..];
                    self.pos += rest.find('\n').unwrap_or(rest.len());
                }
                _ => break,
            }
        }
    }

    fn rule_id(&mut self, name: &str) -> usize {
        if let Some(&id) = self.ids.get(name) {
            return id;
        }
        let id = self.rules.len();
        self.ids.insert(name.to_string(), id);
        self.rules.push(None);
        self.names.push(name.to_string());
        self.used_at.push(self.pos);
        id
    }

    /// A new rule for a group or a repetition inside rule `parent`.
    fn fresh(&mut self, parent: &str, alts: Vec<Vec<Elem>>) -> usize {
        let mut n = self.rules.len();
        let name = loop {
            // `/` cannot be in a name written in the grammar, so no later rule clashes.
            let name = format!("{parent}/{n}");
            if !self.ids.contains_key(&name) {
                break name;
            }
            n += 1;
        };
        let id = self.rule_id(&name);
        self.rules[id] = Some(alts);
        id
    }

    fn name(&mut self) -> Result<String, GrammarError> {
        let start = self.pos;
        while self
            .peek()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            self.pos += 1;
        }
        if self.pos == start {
            return match self.peek() {
                Some(c) => self.err(format!("expected a rule name, found {c:?}")),
                None => self.err("expected a rule name, found the end"),
            };
        }
        Ok(self.src[start..self.pos].to_string())
    }

    /// Whether a rule definition (`name ::=`) starts here.
    fn starts_rule(&mut self) -> bool {
        let save = self.pos;
        let found = self.name().is_ok() && {
            self.space(false);
            self.src[self.pos..].starts_with("::=")
        };
        self.pos = save;
        found
    }

    fn grammar(&mut self) -> Result<(), GrammarError> {
        loop {
            self.space(true);
            if self.peek().is_none() {
                break;
            }
            let name = self.name()?;
            self.space(false);
            if !self.src[self.pos..].starts_with("::=") {
                return self.err(format!("expected `::=` after the rule name `{name}`"));
            }
            self.pos += 3;
            self.space(true);
            let id = self.rule_id(&name);
            if self.rules[id].is_some() {
                return self.err(format!("rule `{name}` is defined twice"));
            }
            let alts = self.alternatives(&name, false)?;
            self.rules[id] = Some(alts);
            self.space(false);
            match self.peek() {
                None | Some('\n' | '\r') => {}
                // An empty last alternative, then the next rule.
                Some(_) if self.starts_rule() => {}
                Some('<' | '!') => {
                    return self.err(format!(
                        "llama.cpp's token syntax (`<[id]>`, `<think>`, `!<[id]>`, in rule \
                         `{name}`) is not supported: write the token's text as a literal"
                    ))
                }
                Some(c) => return self.err(format!("unexpected {c:?} in rule `{name}`")),
            }
        }
        if self.rules.is_empty() {
            return self.err("the grammar has no rules");
        }
        Ok(())
    }

    fn alternatives(&mut self, rule: &str, nested: bool) -> Result<Vec<Vec<Elem>>, GrammarError> {
        let mut alts = vec![self.sequence(rule, nested)?];
        while self.peek() == Some('|') {
            self.pos += 1;
            self.space(true);
            alts.push(self.sequence(rule, nested)?);
        }
        Ok(alts)
    }

    fn sequence(&mut self, rule: &str, nested: bool) -> Result<Vec<Elem>, GrammarError> {
        let mut seq: Vec<Elem> = Vec::new();
        // Where the last symbol (a literal's characters, a class, a name, a group, or a
        // repetition of one) starts, for a repetition after it; `None` before the first.
        let mut last: Option<usize> = None;
        loop {
            self.space(nested);
            let Some(c) = self.peek() else { break };
            if !matches!(c, '*' | '+' | '?' | '{') {
                last = Some(seq.len());
            }
            match c {
                '"' => {
                    self.pos += 1;
                    loop {
                        match self.peek() {
                            // A line break inside is the literal's (as llama.cpp reads it).
                            None => return self.err("unterminated literal"),
                            Some('"') => {
                                self.pos += 1;
                                break;
                            }
                            Some(_) => {
                                let c = self.char()?;
                                seq.push(Elem::Chars {
                                    ranges: Arc::new([(c, c)]),
                                    negated: false,
                                });
                            }
                        }
                    }
                }
                '[' => {
                    self.pos += 1;
                    let negated = self.peek() == Some('^');
                    if negated {
                        self.pos += 1;
                    }
                    let mut ranges = Vec::new();
                    loop {
                        match self.peek() {
                            None => return self.err("unterminated character class"),
                            Some(']') => {
                                self.pos += 1;
                                break;
                            }
                            Some(_) => {
                                let lo = self.char()?;
                                let rest = &self.src[self.pos..];
                                let hi = if rest.starts_with('-') && !rest.starts_with("-]") {
                                    self.pos += 1;
                                    let hi = self.char()?;
                                    if hi < lo {
                                        return self.err(format!(
                                            "character range {:?}-{:?} is backwards",
                                            char::from_u32(lo).unwrap_or('?'),
                                            char::from_u32(hi).unwrap_or('?')
                                        ));
                                    }
                                    hi
                                } else {
                                    lo
                                };
                                ranges.push((lo, hi));
                            }
                        }
                    }
                    if ranges.is_empty() {
                        return self.err("empty character class `[]`");
                    }
                    seq.push(Elem::Chars {
                        ranges: ranges.into(),
                        negated,
                    });
                }
                '.' => {
                    self.pos += 1;
                    seq.push(Elem::Chars {
                        ranges: Arc::new([]),
                        negated: true,
                    });
                }
                '(' => {
                    if self.groups >= MAX_NESTING {
                        return self.err(format!("groups nested more than {MAX_NESTING} deep"));
                    }
                    self.groups += 1;
                    self.pos += 1;
                    self.space(true);
                    let alts = self.alternatives(rule, true)?;
                    self.space(true);
                    if self.peek() != Some(')') {
                        return self.err("expected `)` to close the group");
                    }
                    self.pos += 1;
                    self.groups -= 1;
                    let id = self.fresh(rule, alts);
                    seq.push(Elem::Rule(id));
                }
                '*' | '+' | '?' | '{' => {
                    let (min, max) = self.repetition()?;
                    let Some(start) = last else {
                        return self.err(format!("`{c}` with nothing before it to repeat"));
                    };
                    // The whole symbol: one element, or its own rule (a literal of several
                    // characters, or none).
                    let mut unit: Vec<Elem> = seq.drain(start..).collect();
                    let last = match unit.len() {
                        1 => unit.pop().expect("one"),
                        _ => Elem::Rule(self.fresh(rule, vec![unit])),
                    };
                    self.repeated.push((last.clone(), min, max, self.pos));
                    // Each copy is an element, each optional one a rule of two more.
                    self.elements += min as usize + 3 * (max.unwrap_or(min) - min) as usize;
                    if self.elements > MAX_ELEMENTS {
                        return self.err(format!(
                            "the repetitions write out more than {MAX_ELEMENTS} elements"
                        ));
                    }
                    self.repeat(rule, &mut seq, last, min, max);
                }
                c if c.is_ascii_alphanumeric() || c == '-' || c == '_' => {
                    // A rule name, unless it starts the next rule (`name ::=`).
                    let save = self.pos;
                    let name = self.name()?;
                    let after = self.pos;
                    self.space(false);
                    if self.src[self.pos..].starts_with("::=") {
                        self.pos = save;
                        if nested {
                            return self.err(format!(
                                "rule `{name}` starts inside a group; is a `)` missing?"
                            ));
                        }
                        break;
                    }
                    self.pos = after;
                    let id = self.rule_id(&name);
                    seq.push(Elem::Rule(id));
                }
                _ => break,
            }
        }
        Ok(seq)
    }

    /// `*`, `+`, `?` or `{m}`, `{m,}`, `{m,n}`: (min, max), max `None` for no bound.
    fn repetition(&mut self) -> Result<(u32, Option<u32>), GrammarError> {
        let c = self.bump().expect("peeked");
        Ok(match c {
            '*' => (0, None),
            '+' => (1, None),
            '?' => (0, Some(1)),
            _ => {
                let num = |p: &mut Self| -> Result<Option<u32>, GrammarError> {
                    p.space(false);
                    let start = p.pos;
                    while p.peek().is_some_and(|c| c.is_ascii_digit()) {
                        p.pos += 1;
                    }
                    if p.pos == start {
                        return Ok(None);
                    }
                    match p.src[start..p.pos].parse::<u32>() {
                        Ok(n) if n <= MAX_REPEAT => Ok(Some(n)),
                        _ => p.err(format!(
                            "repetition count {} is over {MAX_REPEAT}",
                            &p.src[start..p.pos]
                        )),
                    }
                };
                let Some(min) = num(self)? else {
                    return self.err("expected a number after `{`");
                };
                self.space(false);
                let max = match self.bump() {
                    Some('}') => return Ok((min, Some(min))),
                    Some(',') => {
                        let max = num(self)?;
                        self.space(false);
                        if self.bump() != Some('}') {
                            return self.err("expected `}` to close the repetition");
                        }
                        max
                    }
                    _ => return self.err("expected `,` or `}` in the repetition"),
                };
                if let Some(max) = max.filter(|&m| m < min) {
                    return self.err(format!("repetition {{{min},{max}}} has max < min"));
                }
                (min, max)
            }
        })
    }

    /// Appends `last` repeated `min` to `max` times, as llama.cpp rewrites repetitions:
    /// `min` copies, then `x*` as `r ::= x r |`, or `max - min` nested optional copies.
    fn repeat(&mut self, rule: &str, seq: &mut Vec<Elem>, last: Elem, min: u32, max: Option<u32>) {
        for _ in 0..min {
            seq.push(last.clone());
        }
        match max {
            None => {
                let id = self.fresh(rule, Vec::new());
                self.rules[id] = Some(vec![vec![last, Elem::Rule(id)], Vec::new()]);
                seq.push(Elem::Rule(id));
            }
            Some(max) if max > min => {
                // Innermost first: r_k ::= x r_{k+1} |, the last r ::= x |.
                let mut inner: Option<usize> = None;
                for _ in min..max {
                    let mut alt = vec![last.clone()];
                    alt.extend(inner.map(Elem::Rule));
                    inner = Some(self.fresh(rule, vec![alt, Vec::new()]));
                }
                seq.push(Elem::Rule(inner.expect("max > min")));
            }
            Some(_) => {}
        }
    }

    /// One character of a literal or class, with its escapes.
    fn char(&mut self) -> Result<u32, GrammarError> {
        let c = self.bump().expect("peeked");
        if c != '\\' {
            return Ok(c as u32);
        }
        let Some(e) = self.bump() else {
            return self.err("`\\` at the end");
        };
        let hex = |p: &mut Self, n: usize| -> Result<u32, GrammarError> {
            let digits = p.src[p.pos..].get(..n).unwrap_or("");
            match u32::from_str_radix(digits, 16) {
                Ok(v) if digits.len() == n && digits.chars().all(|c| c.is_ascii_hexdigit()) => {
                    p.pos += n;
                    Ok(v)
                }
                _ => p.err(format!("`\\{e}` needs {n} hex digits")),
            }
        };
        Ok(match e {
            'n' => '\n' as u32,
            'r' => '\r' as u32,
            't' => '\t' as u32,
            '\\' | '"' | '[' | ']' | '-' | '^' | '/' => e as u32,
            'x' => hex(self, 2)?,
            'u' => hex(self, 4)?,
            'U' => hex(self, 8)?,
            _ => return self.err(format!("unknown escape `\\{e}`")),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn state(g: &str) -> GrammarState {
        GrammarState::new(Arc::new(Grammar::parse(g).unwrap()))
    }

    /// `Some(done)` when `s` starts a text of the grammar, `None` when it does not.
    fn reads(g: &GrammarState, s: &[u8]) -> Option<bool> {
        let mut g = g.clone();
        g.push_all(s).then(|| g.is_done())
    }

    #[test]
    fn literals_alternatives_and_classes() {
        let g = state("root ::= answer ws \".\" | \"unsure\"\nanswer ::= \"yes\" | \"no\" # c\nws ::= [ \\t]*\n");
        for (s, want) in [
            ("yes.", Some(true)),
            ("no \t .", Some(true)),
            ("unsure", Some(true)),
            ("uns", Some(false)),
            ("yes", Some(false)),
            ("yes..", None),
            ("maybe", None),
            ("", Some(false)),
        ] {
            assert_eq!(reads(&g, s.as_bytes()), want, "{s:?}");
        }
    }

    #[test]
    fn repetitions() {
        let g = state("root ::= [a-c]{2,3} \"-\"? [0-9]+ (\"x\" | \"y\")* \"!\"{1}");
        for (s, want) in [
            ("ab1!", Some(true)),
            ("abc-42xyx!", Some(true)),
            ("a1", None),
            ("abcd", None),
            ("ab-!", None),
            ("ab12", Some(false)),
            ("ab1!!", None),
        ] {
            assert_eq!(reads(&g, s.as_bytes()), want, "{s:?}");
        }
        let g = state("root ::= \"a\"{2,} | \"b\"{0,2} \"c\"");
        for (s, want) in [
            ("a", Some(false)),
            ("aa", Some(true)),
            ("aaaa", Some(true)),
            ("c", Some(true)),
            ("bbc", Some(true)),
            ("bbbc", None),
        ] {
            assert_eq!(reads(&g, s.as_bytes()), want, "{s:?}");
        }
    }

    #[test]
    fn negated_classes_any_and_utf8() {
        let g = state("root ::= \"\\\"\" [^\"\\\\]* \"\\\"\" . \"é\"");
        assert_eq!(reads(&g, "\"ab c\"xé".as_bytes()), Some(true));
        assert_eq!(reads(&g, "\"a\\".as_bytes()), None);
        assert_eq!(reads(&g, "\"naïve 😀\"😀é".as_bytes()), Some(true));
        // A token may end inside a character the grammar allows...
        let e = "é".as_bytes();
        assert_eq!(reads(&g, &[b"\"\"x", &e[..1]].concat()), Some(false));
        // ...but not inside one it cannot: `é` is C3 A9; C3 starts U+00C0..U+00FF only.
        let g = state("root ::= [a-z\\u0100-\\u017f]");
        assert_eq!(reads(&g, &e[..1]), None);
        assert_eq!(reads(&g, &"ő".as_bytes()[..1]), Some(false));
        assert_eq!(reads(&g, "ő".as_bytes()), Some(true));
        assert_eq!(reads(&g, &[0xff]), None);
        assert_eq!(reads(&g, &[b'a', 0x80]), None);
        // Overlong forms of `a` (U+0061) are not UTF-8, whatever byte they stop at.
        assert_eq!(reads(&g, &[0xc1, 0xa1]), None);
        assert_eq!(reads(&g, &[0xe0, 0x81, 0xa1]), None);
        assert_eq!(reads(&g, &[0xe0, 0x81]), None);
        assert_eq!(reads(&g, &[0xf0, 0x80, 0x81, 0xa1]), None);
        // Nor are surrogates, or code points beyond U+10FFFF.
        let any = state("root ::= .");
        assert_eq!(reads(&any, &[0xed, 0xa0, 0x80]), None);
        // Refused at the byte that makes it a surrogate, not when no token can finish it.
        assert_eq!(reads(&any, &[0xed, 0xa0]), None);
        assert_eq!(reads(&any, &[0xed, 0x9f]), Some(false));
        // Excluded ranges that together cover what a partial character can be.
        let g = state("root ::= [^\\u0800-\\u0fff\\u1000-\\u1fff]");
        assert_eq!(reads(&g, &[0xe0, 0xa0]), None);
        assert_eq!(reads(&g, &[0xe1]), None);
        assert_eq!(reads(&g, &[0xe2]), Some(false));
        assert_eq!(reads(&any, &[0xf4, 0x90]), None);
        assert_eq!(reads(&any, "\u{10ffff}".as_bytes()), Some(true));
    }

    #[test]
    fn a_repetition_repeats_the_whole_symbol_before_it() {
        let g = state(
            "root ::= \"ab\"* \"O-O\" \"-O\"? [x-y]{2} (\"c\" | \"de\")+ name?\nname ::= \"zz\"",
        );
        for (s, want) in [
            ("ababO-O-Oxydec", Some(true)),
            ("O-Oxyc", Some(true)),
            ("O-Oxycdezz", Some(true)),
            ("abbO-O", None),
            ("O-O-xy", None),
            ("O-Oxyz", None),
            ("O-Oxycz", Some(false)),
        ] {
            assert_eq!(reads(&g, s.as_bytes()), want, "{s:?}");
        }
        // An empty literal repeated is the empty literal, not the symbol before it.
        let g = state("root ::= \"a\" \"\"?");
        assert_eq!(reads(&g, b""), Some(false));
        assert_eq!(reads(&g, b"a"), Some(true));
    }

    #[test]
    fn ambiguity_is_refused_not_followed_forever() {
        // Repeating what can be empty: each text would have as many readings as copies.
        for g in [
            "root ::= [a]?{0,65536}",
            "root ::= (\"a\"?)*",
            "root ::= (\"\")+ \"b\"",
        ] {
            let e = Grammar::parse(g).unwrap_err().to_string();
            assert!(e.contains("can match the empty text"), "{g}: {e}");
        }
        // Its count is quoted as written.
        let e = Grammar::parse("root ::= (\"a\"? | \"b\"?){64}")
            .unwrap_err()
            .to_string();
        assert!(e.contains("repeating (`{64}`)"), "{e}");
        // A line break inside a literal or a class is theirs (as llama.cpp reads it).
        let g = state("root ::= \"a\nb\" [\n]");
        assert_eq!(reads(&g, b"a\nb\n"), Some(true));
        // 20 000 alternatives that all start alike: more ways to read "x" than MAX_STACKS.
        let mut g = String::from("root ::= ");
        g += &(0..20_000)
            .map(|i| format!("a{i}"))
            .collect::<Vec<_>>()
            .join(" | ");
        for i in 0..20_000 {
            g += &format!("\na{i} ::= \"x\" \"{i}\"");
        }
        let s = state(&g);
        assert!(s.is_ambiguous());
        let s = state(&g.replace("root ::= a0 | a1 | a2 |", "root ::= a0 | a1 | a2 #"));
        assert!(!s.is_ambiguous());
        assert_eq!(reads(&s, b"x2"), Some(true));
    }

    #[test]
    fn deep_grammars_and_texts_do_not_overflow_the_stack() {
        // 20 000 rules, each the next one: expanded, checked and freed without recursing.
        let mut g = String::from("root ::= r0\n");
        for i in 0..20_000 {
            g += &format!("r{i} ::= r{}\n", i + 1);
        }
        g += "r20000 ::= \"y\"\n";
        let s = state(&g);
        assert_eq!(reads(&s, b"y"), Some(true));
        // A text nesting 200 000 deep: a stack of 200 000 frames, freed without recursing.
        let s = state("root ::= a\na ::= \"(\" a \")\" | \"\"");
        let mut t = s.clone();
        assert!(t.push_all(&[b'('; 200_000]));
        assert!(!t.is_done());
        drop(t);
        // A stack that ends through 5 000 empty endings at once (each byte re-expands them
        // all: quadratic, as llama.cpp is on such a grammar).
        let s = state("root ::= a\na ::= \"(\" a b | \"\"\nb ::= \"\"");
        let mut t = s.clone();
        assert!(t.push_all(&[b'('; 5_000]));
        assert!(t.is_done());
    }

    #[test]
    fn empty_rules_and_empty_last_alternatives() {
        let g = state("root ::= a \"x\" b\na ::=\nb ::= \"y\" |\nc ::= \"z\"");
        assert_eq!(reads(&g, b"x"), Some(true));
        assert_eq!(reads(&g, b"xy"), Some(true));
        assert_eq!(reads(&g, b"xz"), None);
    }

    #[test]
    fn rules_go_on_over_lines_where_llama_cpp_allows() {
        let g = state(
            "root ::=\n  \"{\" (\n    \"a\" |\n    \"b\"\n  )* \"}\"\n\n# done\nother ::= \"x\"\n",
        );
        assert_eq!(reads(&g, b"{abba}"), Some(true));
        assert_eq!(reads(&g, b"x"), None);
    }

    #[test]
    fn bad_grammars_are_refused_with_the_reason() {
        for (g, want) in [
            ("", "no rules"),
            ("answer ::= \"y\"", "no rule named `root`"),
            (
                "root ::= value",
                "rule `value` is used (line 1) but not defined",
            ),
            (
                "root ::= \"a\"\nroot ::= \"b\"",
                "line 2: rule `root` is defined twice",
            ),
            (
                "root ::= root \"a\" | \"b\"",
                "left-recursive (root → root)",
            ),
            ("root ::= x\nx ::= \"a\"? root", "left-recursive"),
            ("root ::= \"abc", "line 1: unterminated literal"),
            ("root ::= [abc", "unterminated character class"),
            ("root ::= [z-a]", "backwards"),
            ("root ::= []", "empty character class"),
            ("root ::= * \"a\"", "nothing before it"),
            ("root ::= \"a\"{3,1}", "max < min"),
            ("root ::= \"a\"{99999999}", "over 65536"),
            ("root ::= \"a\" )", "unexpected ')'"),
            ("root ::= <[10]> \"a\"", "token syntax"),
            ("root ::= \"a\" !<[11]>", "token syntax"),
            ("root ::= (\"a\"", "expected `)`"),
            ("root ::= \"\\q\"", "unknown escape `\\q`"),
            ("root ::= \"\\x4\"", "needs 2 hex digits"),
            ("root \"a\"", "expected `::=` after the rule name `root`"),
        ] {
            let e = Grammar::parse(g).unwrap_err().to_string();
            assert!(e.contains(want), "{g:?}: {e}");
        }
        // Too large once written out, or nested too deep: refused, not run out of memory or
        // stack on.
        let big = format!("root ::= {}", "[a-z]{0,60000} ".repeat(12));
        let e = Grammar::parse(&big).unwrap_err().to_string();
        assert!(e.contains("more than 2097152 elements"), "{e}");
        let deep = format!("root ::= {}\"a\"{}", "(".repeat(300), ")".repeat(300));
        let e = Grammar::parse(&deep).unwrap_err().to_string();
        assert!(e.contains("nested more than 256"), "{e}");
    }

    /// JSON objects as in [`crate::json_mode`]: whitespace in one place between any two tokens,
    /// at most 32 bytes of it, nothing after the object. The example the README points to.
    const JSON: &str = include_str!("../../../examples/grammars/json.gbnf");

    /// Text that is mostly JSON, with mistakes.
    fn jsonish() -> impl Strategy<Value = Vec<u8>> {
        let piece = prop_oneof![
            Just(b"{".to_vec()),
            Just(b"}".to_vec()),
            Just(b"[".to_vec()),
            Just(b"]".to_vec()),
            Just(b"\"".to_vec()),
            Just(b":".to_vec()),
            Just(b",".to_vec()),
            Just(b" ".to_vec()),
            Just(b"\n".to_vec()),
            Just(b"\\".to_vec()),
            Just(b"u00e9".to_vec()),
            Just(b"true".to_vec()),
            Just(b"nul".to_vec()),
            Just(b"-0.5e+3".to_vec()),
            Just(b"12".to_vec()),
            Just(b".".to_vec()),
            Just(b"x".to_vec()),
            Just("é".as_bytes().to_vec()),
            Just(vec![0x01]),
            // UTF-8 in pieces, and bytes no UTF-8 text has there.
            Just(vec![0xc3]),
            Just(vec![0xa9]),
            Just(vec![0xe0]),
            Just(vec![0xed, 0xa0]),
            Just(vec![0xf0, 0x9f]),
            Just(vec![0xf4, 0x90]),
            Just(vec![0xc0]),
            Just(vec![0xff]),
        ];
        prop::collection::vec(piece, 0..24).prop_map(|v| v.concat())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// The JSON grammar reads exactly what the JSON mode checker reads.
        #[test]
        fn json_grammar_matches_the_json_mode_checker(
            s in prop_oneof![
                jsonish(),
                jsonish().prop_map(|s| [b"{\"a\":".to_vec(), s].concat()),
                jsonish().prop_map(|s| [b"{\"k\": [".to_vec(), s, b"]}".to_vec()].concat()),
            ]
        ) {
            let g = state(JSON);
            let mut j = crate::json_mode::JsonObject::new();
            let want = j.push_all(&s).then(|| j.is_done());
            prop_assert_eq!(reads(&g, &s), want, "{:?}", String::from_utf8_lossy(&s));
        }

        /// The mask's walk over the sorted vocabulary allows exactly the tokens that reading
        /// each one's bytes from the state accepts.
        #[test]
        fn mask_is_each_token_checked_alone(
            prefix in jsonish(),
            vocab in prop::collection::vec(jsonish(), 1..80),
            eos in 0usize..80,
        ) {
            let tokens: Vec<Box<[u8]>> = vocab.into_iter().map(Vec::into_boxed_slice).collect();
            let eos = [(eos % tokens.len()) as u32];
            let mut g = state(JSON);
            // The longest prefix the grammar reads.
            for &b in &prefix {
                let mut next = g.clone();
                if !next.push(b) {
                    break;
                }
                g = next;
            }
            let mut logits = vec![0.0f32; tokens.len()];
            let by_bytes = sorted_by_bytes(&tokens);
            let left = g.mask(&mut logits, &tokens, &by_bytes, &eos);
            // Again, from the cache, on a copy of the state.
            let mut again = vec![0.0f32; tokens.len()];
            prop_assert_eq!(g.clone().mask(&mut again, &tokens, &by_bytes, &eos), left);
            prop_assert_eq!(&again, &logits);
            for (id, t) in tokens.iter().enumerate() {
                let want = if eos.contains(&(id as u32)) {
                    g.is_done()
                } else {
                    !t.is_empty() && g.clone().push_all(t)
                };
                prop_assert_eq!(logits[id] == 0.0, want, "token {:?}", String::from_utf8_lossy(t));
            }
            prop_assert_eq!(left, logits.iter().filter(|l| **l == 0.0).count());
        }
    }
}
