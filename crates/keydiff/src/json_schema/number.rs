//! Bounds on `number`: `minimum`, `maximum`, `exclusiveMinimum`, `exclusiveMaximum` as a
//! grammar of the decimal texts within them.
//!
//! A bounded number is written without an exponent: `-`, an integer part (`0` or no leading
//! zero) and an optional fraction of 1 to [`MAX_FRACTION`] digits, the forms the `number`
//! primitive writes without its exponent. A negative zero (`-0`, `-0.0`) is not written; `0`
//! is. Each bound is read as the shortest decimal of its double (serde_json parses with
//! `float_roundtrip`, so `0.1` is one tenth and `3e23` is 3·10²³; a bound written with more
//! than ~16 significant digits is read as its double), with at most 38 integer digits. A
//! bound with more than [`MAX_FRACTION`] decimals moves inward onto the numbers written.
//!
//! The texts are compared digit by digit: a value's integer part against the bounds' (the
//! digit ranges integers use), then, where the integer parts are equal, its fraction against
//! theirs.

use serde_json::{Map, Value};

use super::{digits_range, BOUNDS};

/// Fraction digits a bounded number has at most (as the `number` primitive).
pub(super) const MAX_FRACTION: usize = 16;

/// A non-negative decimal: its integer part and its fraction's digits, without trailing
/// zeros. The derived order is the numbers' (integer parts first, then the fractions'
/// digits lexicographically, which without trailing zeros is their order).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Dec {
    int: u128,
    frac: String,
}

impl Dec {
    fn zero() -> Dec {
        Dec {
            int: 0,
            frac: String::new(),
        }
    }
}

/// A signed decimal: (negative, magnitude); zero is not negative.
type Signed = (bool, Dec);

fn less(a: &Signed, b: &Signed) -> bool {
    match (a.0, b.0) {
        (true, false) => true,
        (false, true) => false,
        (false, false) => a.1 < b.1,
        (true, true) => a.1 > b.1,
    }
}

/// The decimal a JSON number's text writes (`-12.5`, `1e-7`, `2.5E+3`).
fn parse(text: &str) -> Result<Signed, String> {
    let (neg, rest) = match text.strip_prefix('-') {
        Some(r) => (true, r),
        None => (false, text),
    };
    let (mant, exp) = match rest.find(['e', 'E']) {
        Some(i) => (
            &rest[..i],
            rest[i + 1..].parse::<i64>().map_err(|e| e.to_string())?,
        ),
        None => (rest, 0),
    };
    let (ip, fp) = mant.split_once('.').unwrap_or((mant, ""));
    let digits: String = format!("{ip}{fp}");
    let point = ip.len() as i64 + exp;
    // The digits before and after the point, padded with zeros where the exponent moves it
    // past them (bounded: a JSON number of 1e400 is refused by serde_json before).
    if !(-400..=400).contains(&point) {
        return Err(format!("{text} is out of range"));
    }
    let (int, frac) = if point <= 0 {
        (String::new(), "0".repeat(-point as usize) + &digits)
    } else if point as usize >= digits.len() {
        (
            digits.clone() + &"0".repeat(point as usize - digits.len()),
            String::new(),
        )
    } else {
        let (a, b) = digits.split_at(point as usize);
        (a.to_string(), b.to_string())
    };
    let int = int.trim_start_matches('0');
    let frac = frac.trim_end_matches('0');
    if int.len() > 38 {
        return Err(format!("{text} has more than 38 integer digits"));
    }
    let dec = Dec {
        int: if int.is_empty() {
            0
        } else {
            int.parse().map_err(|_| format!("{text} is out of range"))?
        },
        frac: frac.to_string(),
    };
    Ok((neg && dec != Dec::zero(), dec))
}

/// A bound moved onto the numbers written (at most [`MAX_FRACTION`] decimals): one with
/// more decimals is neither reached nor passed by them, so a lower bound becomes the next
/// such number up and an upper one the next down, both allowed themselves.
fn to_grid(v: Signed, lower: bool, inclusive: bool) -> (Signed, bool) {
    if v.1.frac.len() <= MAX_FRACTION {
        return (v, inclusive);
    }
    let (neg, d) = v;
    let cut = Dec {
        int: d.int,
        frac: d.frac[..MAX_FRACTION].trim_end_matches('0').to_string(),
    };
    // Away from zero: one unit of the last decimal more.
    let up = || {
        let digits = format!("{:0<width$}", cut.frac, width = MAX_FRACTION);
        let n: u64 = digits.parse::<u64>().expect("digits") + 1;
        let carry = n == 10u64.pow(MAX_FRACTION as u32);
        let frac = if carry {
            String::new()
        } else {
            format!("{n:0width$}", width = MAX_FRACTION)
                .trim_end_matches('0')
                .to_string()
        };
        Dec {
            int: d.int + carry as u128,
            frac,
        }
    };
    // Toward +∞ for a lower bound, −∞ for an upper one.
    let m = match (lower, neg) {
        (true, false) | (false, true) => up(),
        _ => cut.clone(),
    };
    ((neg && m != Dec::zero(), m), true)
}

/// A bound: its value and whether it is allowed itself.
type Bound = (Signed, bool);

/// The GBNF (without the trailing space) of the decimal numbers within the bounds of `s`, or
/// an error naming the problem.
pub(super) fn bounded(s: &Map<String, Value>) -> Result<String, String> {
    let mut lower: Option<Bound> = None;
    let mut upper: Option<Bound> = None;
    for key in BOUNDS {
        let Some(v) = s.get(key) else { continue };
        let Some(f) = v.as_f64() else {
            return Err(format!("`{key}` {v} must be a number (as from draft 6)"));
        };
        if f.abs() >= 1e38 {
            // Far beyond any number written: no bound on the open side.
            if (f < 0.0) == key.ends_with("inimum") {
                continue;
            }
            return Err(format!("`{key}` {v}: numbers past ±1e38 are not supported"));
        }
        let value = parse(&v.to_string()).map_err(|e| format!("`{key}`: {e}"))?;
        let is_lower = key.ends_with("inimum");
        let (value, inclusive) = to_grid(value, is_lower, !key.starts_with("exclusive"));
        if is_lower {
            // The tighter of two lower bounds: the larger, exclusive on a tie.
            lower = Some(match lower {
                Some((l, li)) if less(&value, &l) || (value == l && !li) => (l, li),
                _ => (value, inclusive),
            });
        } else {
            upper = Some(match upper {
                Some((u, ui)) if less(&u, &value) || (value == u && !ui) => (u, ui),
                _ => (value, inclusive),
            });
        }
    }
    if let (Some((l, li)), Some((u, ui))) = (&lower, &upper) {
        if less(u, l) || (l == u && !(li & ui)) {
            return Err("the bounds leave no number".into());
        }
    }
    let zero: Signed = (false, Dec::zero());
    let mut alts = Vec::new();
    // Negative values: `-` and their magnitudes, above 0 (no `-0`).
    if lower.as_ref().is_none_or(|(l, _)| l.0) {
        let from = match &upper {
            Some(((true, u), ui)) => (u.clone(), *ui),
            _ => (Dec::zero(), false),
        };
        let to = lower.as_ref().map(|((_, l), li)| (l.clone(), *li));
        if let Some(m) = magnitudes(from, to) {
            alts.push(format!(r#""-" ({m})"#));
        }
    }
    // Values from 0 up.
    if upper
        .as_ref()
        .is_none_or(|(u, ui)| less(&zero, u) || (*u == zero && *ui))
    {
        let from = match &lower {
            Some(((false, l), li)) => (l.clone(), *li),
            _ => (Dec::zero(), true),
        };
        let to = upper.as_ref().map(|((_, u), ui)| (u.clone(), *ui));
        if let Some(m) = magnitudes(from, to) {
            alts.push(format!("({m})"));
        }
    }
    match alts.is_empty() {
        true => Err("the bounds leave no number".into()),
        false => Ok(format!("({})", alts.join(" | "))),
    }
}

/// GBNF for the texts of non-negative decimals from `from` to `to` (`None`: no end), each
/// with whether it is allowed itself; `None` when there is none.
fn magnitudes(from: (Dec, bool), to: Option<(Dec, bool)>) -> Option<String> {
    if let Some(to) = &to {
        if from.0 > to.0 || (from.0 == to.0 && !(from.1 && to.1)) {
            return None;
        }
    }
    let any = format!(r#"("." [0-9]{{1,{MAX_FRACTION}}})?"#);
    let int = |n: u128| format!("\"{n}\"");
    let lo = Some((from.0.frac.as_str(), from.1));
    let mut alts = Vec::new();
    let mut push = |int: String, frac: Option<String>| {
        if let Some(f) = frac {
            alts.push(format!("{int} {f}"));
        }
    };
    match &to {
        Some(to) if to.0.int == from.0.int => {
            push(
                int(from.0.int),
                fraction(lo, Some((to.0.frac.as_str(), to.1))),
            );
        }
        _ => {
            push(int(from.0.int), fraction(lo, None));
            let next = from.0.int + 1;
            match &to {
                None => push(format!("({})", digits_range(next, None)), Some(any.clone())),
                Some(to) => {
                    if next < to.0.int {
                        let between = digits_range(next, Some(to.0.int - 1));
                        push(format!("({between})"), Some(any.clone()));
                    }
                    push(
                        int(to.0.int),
                        fraction(None, Some((to.0.frac.as_str(), to.1))),
                    );
                }
            }
        }
    }
    (!alts.is_empty()).then(|| alts.join(" | "))
}

/// GBNF for a number's optional fraction (`""`, or `.` and 1 to [`MAX_FRACTION`] digits)
/// whose value F is at least `lo` and at most `hi`: each the fraction digits of a bound
/// (no trailing zeros) and whether F may equal it. `None` when no fraction fits.
fn fraction(lo: Option<(&str, bool)>, hi: Option<(&str, bool)>) -> Option<String> {
    let c = Fraction {
        lo: lo.map_or(&[][..], |l| l.0.as_bytes()),
        lo_in: lo.is_none_or(|l| l.1),
        hi: hi.map_or(&[][..], |h| h.0.as_bytes()),
        hi_in: hi.is_none_or(|h| h.1),
    };
    let mut alts = Vec::new();
    // No fraction: the value 0.
    if c.may_end(0, lo.is_some(), hi.is_some()) {
        alts.push(r#""""#.to_string());
    }
    if let Some(digits) = c.digits(0, lo.is_some(), hi.is_some(), true) {
        alts.push(format!(r#""." {digits}"#));
    }
    (!alts.is_empty()).then(|| format!("({})", alts.join(" | ")))
}

/// The bounds of a fraction, as in [`fraction`].
struct Fraction<'a> {
    lo: &'a [u8],
    lo_in: bool,
    hi: &'a [u8],
    hi_in: bool,
}

impl Fraction<'_> {
    /// Whether the digits may end at `i`, the value then being its first `i` digits (equal
    /// to `lo`'s if `eq_lo`, to `hi`'s if `eq_hi`) followed by zeros.
    fn may_end(&self, i: usize, eq_lo: bool, eq_hi: bool) -> bool {
        // Equal to a bound's digits so far, and the bound has no more: equal to it.
        let lo_ok = !eq_lo || (i >= self.lo.len() && self.lo_in);
        let hi_ok = !eq_hi || i < self.hi.len() || self.hi_in;
        lo_ok && hi_ok
    }

    /// GBNF for the digits from `i` on (at least one when `must`), the first `i` equal to
    /// `lo`'s when `eq_lo` and to `hi`'s when `eq_hi`; `None` when none fits.
    fn digits(&self, i: usize, eq_lo: bool, eq_hi: bool, must: bool) -> Option<String> {
        let left = MAX_FRACTION - i;
        if !eq_lo && !eq_hi {
            return match (left, must) {
                (0, true) => None,
                (0, false) => Some(r#""""#.to_string()),
                _ => Some(format!("[0-9]{{{},{left}}}", must as usize)),
            };
        }
        let mut alts = Vec::new();
        if !must && self.may_end(i, eq_lo, eq_hi) {
            alts.push(r#""""#.to_string());
        }
        if left > 0 {
            let lo_d = self.lo.get(i).copied().unwrap_or(b'0');
            let hi_d = self.hi.get(i).copied().unwrap_or(b'0');
            // Digits strictly between: any digits after.
            let from = if eq_lo { lo_d + 1 } else { b'0' };
            let to = if eq_hi { hi_d.wrapping_sub(1) } else { b'9' };
            if !(eq_hi && hi_d == b'0') && from <= to {
                let rest = match left - 1 {
                    0 => String::new(),
                    n => format!(" [0-9]{{0,{n}}}"),
                };
                alts.push(format!("[{}-{}]{rest}", from as char, to as char));
            }
            if eq_lo {
                let both = eq_hi && lo_d == hi_d;
                if let Some(next) = self.digits(i + 1, true, both, false) {
                    alts.push(format!("\"{}\" {next}", lo_d as char));
                }
            }
            if eq_hi && !(eq_lo && lo_d == hi_d) {
                if let Some(next) = self.digits(i + 1, false, true, false) {
                    alts.push(format!("\"{}\" {next}", hi_d as char));
                }
            }
        }
        (!alts.is_empty()).then(|| format!("({})", alts.join(" | ")))
    }
}
