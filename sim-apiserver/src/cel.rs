//! The part of CEL that admission webhooks' `matchConditions` use, evaluated
//! over JSON: the real server skips a webhook whose conditions do not all
//! hold, so a simulator that ignored them would call webhooks the real one
//! never calls (every write of an operator that exempts itself, say).
//!
//! Supported: `null`, `true`, `false`, integers, floats, strings in single
//! or double quotes, lists `[a, b]`; variables; field selection `a.b`;
//! indexing `a[k]`; `!`, `-`, `+`, `==`, `!=`, `<`, `<=`, `>`, `>=`, `in`,
//! `&&`, `||`, `c ? a : b`; `has(a.b)`; `size(x)` and `x.size()`;
//! `s.startsWith(t)`, `s.endsWith(t)`, `s.contains(t)`; the macros
//! `l.exists(x, p)` and `l.all(x, p)`. Anything else is a parse or
//! evaluation error naming what is not supported, never a silent guess.
//!
//! Errors follow CEL: selecting a missing field is an error, and `&&` / `||`
//! absorb an error when the other side alone decides the result (`false &&
//! error` is `false`, `true || error` is `true`).

use std::borrow::Cow;
use std::collections::HashMap;

use serde_json::Value;

/// A parsed expression.
#[derive(Debug, Clone, PartialEq)]
pub enum Expr {
    /// A literal value.
    Lit(Value),
    /// A variable.
    Ident(String),
    /// `operand.field`.
    Select(Box<Expr>, String),
    /// `operand[index]`.
    Index(Box<Expr>, Box<Expr>),
    /// `[a, b, ...]`.
    List(Vec<Expr>),
    /// `!x`.
    Not(Box<Expr>),
    /// `-x`.
    Neg(Box<Expr>),
    /// `a || b` (`Or`) or `a && b` (`And`), evaluated lazily.
    Logic(Logic, Box<Expr>, Box<Expr>),
    /// A binary operator with both sides evaluated.
    Binary(BinOp, Box<Expr>, Box<Expr>),
    /// `cond ? then : otherwise`.
    Cond(Box<Expr>, Box<Expr>, Box<Expr>),
    /// `has(operand.field)`.
    Has(Box<Expr>, String),
    /// `target.exists(var, predicate)` (`all` when the flag is set).
    Quantifier {
        /// The list (or map, whose keys are iterated).
        target: Box<Expr>,
        /// The bound variable.
        var: String,
        /// The predicate.
        predicate: Box<Expr>,
        /// `all` rather than `exists`.
        all: bool,
    },
    /// A function or method call: `name(args)` or `target.name(args)`.
    Call {
        /// The receiver, for a method call.
        target: Option<Box<Expr>>,
        /// The function.
        name: String,
        /// The arguments.
        args: Vec<Expr>,
    },
}

/// A short-circuit operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logic {
    /// `||`
    Or,
    /// `&&`
    And,
}

/// A binary operator with both sides evaluated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BinOp {
    /// `==`
    Eq,
    /// `!=`
    Ne,
    /// `<`
    Lt,
    /// `<=`
    Le,
    /// `>`
    Gt,
    /// `>=`
    Ge,
    /// `in`
    In,
    /// `+`
    Add,
    /// `-`
    Sub,
}

/// Most tokens in one expression.
const MAX_TOKENS: usize = 4096;
/// Deepest nesting of parentheses, lists, calls and unary operators.
const MAX_NESTING: usize = 128;
/// Deepest expression tree, so evaluating it cannot exhaust a thread's stack.
const MAX_DEPTH: usize = 256;

/// Parses `source`; the error says what was expected and where. An
/// expression of more than 4096 tokens or nested deeper than its limits is
/// refused, whoever wrote it.
pub fn parse(source: &str) -> Result<Expr, String> {
    let tokens = lex(source)?;
    let mut parser = Parser {
        tokens,
        pos: 0,
        nesting: 0,
    };
    let expr = parser.expr()?;
    if *parser.peek() != Token::End {
        return Err(format!(
            "unexpected {} at offset {}",
            parser.peek(),
            parser.offset()
        ));
    }
    if depth(&expr) > MAX_DEPTH {
        return Err(format!(
            "the expression nests more than {MAX_DEPTH} levels deep"
        ));
    }
    Ok(expr)
}

/// Evaluates `expr` with `vars` bound; `Ok` holds the result, whatever its
/// type (a match condition must give a bool, which the caller checks).
pub fn eval(expr: &Expr, vars: &HashMap<&str, &Value>) -> Result<Value, String> {
    let mut scope = Scope {
        vars,
        bound: Vec::new(),
    };
    scope.eval(expr).map(Cow::into_owned)
}

/// The depth of an expression tree, walked without recursion.
fn depth(expr: &Expr) -> usize {
    let mut deepest = 0;
    let mut stack = vec![(expr, 1)];
    while let Some((e, d)) = stack.pop() {
        deepest = deepest.max(d);
        stack.extend(children(e).into_iter().map(|c| (c, d + 1)));
    }
    deepest
}

/// The subexpressions of `e`.
fn children(e: &Expr) -> Vec<&Expr> {
    match e {
        Expr::Lit(_) | Expr::Ident(_) => vec![],
        Expr::Select(a, _) | Expr::Has(a, _) | Expr::Not(a) | Expr::Neg(a) => vec![a],
        Expr::Index(a, b) | Expr::Logic(_, a, b) | Expr::Binary(_, a, b) => vec![a, b],
        Expr::Cond(a, b, c) => vec![a, b, c],
        Expr::List(items) => items.iter().collect(),
        Expr::Quantifier {
            target, predicate, ..
        } => vec![target, predicate],
        Expr::Call { target, args, .. } => target.iter().map(|t| &**t).chain(args).collect(),
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Token {
    Ident(String),
    Str(String),
    Int(i64),
    Float(f64),
    Punct(&'static str),
    End,
}

impl std::fmt::Display for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Token::Ident(s) => write!(f, "'{s}'"),
            Token::Str(s) => write!(f, "string {s:?}"),
            Token::Int(i) => write!(f, "{i}"),
            Token::Float(x) => write!(f, "{x}"),
            Token::Punct(p) => write!(f, "'{p}'"),
            Token::End => f.write_str("end of expression"),
        }
    }
}

const PUNCTS: [&str; 21] = [
    "==", "!=", "<=", ">=", "&&", "||", "<", ">", "!", "?", ":", ".", ",", "(", ")", "[", "]", "+",
    "-", "{", "}",
];

fn lex(source: &str) -> Result<Vec<(Token, usize)>, String> {
    let bytes = source.as_bytes();
    let mut tokens = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if tokens.len() >= MAX_TOKENS {
            return Err(format!("the expression is longer than {MAX_TOKENS} tokens"));
        }
        let c = bytes[i];
        if c.is_ascii_whitespace() {
            i += 1;
            continue;
        }
        let start = i;
        if c.is_ascii_alphabetic() || c == b'_' {
            while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_') {
                i += 1;
            }
            tokens.push((Token::Ident(source[start..i].to_owned()), start));
        } else if c.is_ascii_digit() {
            while i < bytes.len() && (bytes[i].is_ascii_digit() || bytes[i] == b'.') {
                i += 1;
            }
            let text = &source[start..i];
            let token = if text.contains('.') {
                Token::Float(
                    text.parse()
                        .map_err(|_| format!("bad number {text:?} at offset {start}"))?,
                )
            } else {
                Token::Int(
                    text.parse()
                        .map_err(|_| format!("bad number {text:?} at offset {start}"))?,
                )
            };
            tokens.push((token, start));
        } else if c == b'\'' || c == b'"' {
            i += 1;
            let mut text = String::new();
            loop {
                let Some(ch) = source[i..].chars().next() else {
                    return Err(format!("unterminated string at offset {start}"));
                };
                i += ch.len_utf8();
                if ch as u32 == u32::from(c) {
                    break;
                }
                if ch == '\\' {
                    let Some(esc) = source[i..].chars().next() else {
                        return Err(format!("unterminated string at offset {start}"));
                    };
                    i += esc.len_utf8();
                    text.push(match esc {
                        'n' => '\n',
                        't' => '\t',
                        'r' => '\r',
                        '\\' | '\'' | '"' => esc,
                        other => {
                            return Err(format!(
                                "unsupported escape \\{other} at offset {}",
                                i - 2
                            ));
                        }
                    });
                } else {
                    text.push(ch);
                }
            }
            tokens.push((Token::Str(text), start));
        } else {
            let Some(p) = PUNCTS.iter().find(|p| source[i..].starts_with(**p)) else {
                return Err(format!(
                    "unexpected character {:?} at offset {start}",
                    source[i..].chars().next().unwrap_or(' ')
                ));
            };
            i += p.len();
            tokens.push((Token::Punct(p), start));
        }
    }
    tokens.push((Token::End, source.len()));
    Ok(tokens)
}

struct Parser {
    tokens: Vec<(Token, usize)>,
    pos: usize,
    /// How many `expr`/`unary` calls are open.
    nesting: usize,
}

impl Parser {
    fn peek(&self) -> &Token {
        self.tokens.get(self.pos).map_or(&Token::End, |(t, _)| t)
    }

    fn offset(&self) -> usize {
        self.tokens.get(self.pos).map_or(0, |(_, o)| *o)
    }

    fn next(&mut self) -> Token {
        let t = self.peek().clone();
        self.pos += 1;
        t
    }

    fn eat(&mut self, punct: &str) -> bool {
        if matches!(self.peek(), Token::Punct(p) if *p == punct) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    fn expect(&mut self, punct: &str) -> Result<(), String> {
        if self.eat(punct) {
            Ok(())
        } else {
            Err(format!(
                "expected '{punct}' but found {} at offset {}",
                self.peek(),
                self.offset()
            ))
        }
    }

    /// Counts one more open level; refuses one past [`MAX_NESTING`].
    fn enter(&mut self) -> Result<(), String> {
        self.nesting += 1;
        if self.nesting > MAX_NESTING {
            return Err(format!(
                "the expression nests more than {MAX_NESTING} levels deep at offset {}",
                self.offset()
            ));
        }
        Ok(())
    }

    fn expr(&mut self) -> Result<Expr, String> {
        self.enter()?;
        let e = self.conditional();
        self.nesting -= 1;
        e
    }

    fn conditional(&mut self) -> Result<Expr, String> {
        let cond = self.or()?;
        if !self.eat("?") {
            return Ok(cond);
        }
        let then = self.or()?;
        self.expect(":")?;
        let otherwise = self.expr()?;
        Ok(Expr::Cond(
            Box::new(cond),
            Box::new(then),
            Box::new(otherwise),
        ))
    }

    fn or(&mut self) -> Result<Expr, String> {
        let mut left = self.and()?;
        while self.eat("||") {
            let right = self.and()?;
            left = Expr::Logic(Logic::Or, Box::new(left), Box::new(right));
        }
        Ok(left)
    }

    fn and(&mut self) -> Result<Expr, String> {
        let mut left = self.relation()?;
        while self.eat("&&") {
            let right = self.relation()?;
            left = Expr::Logic(Logic::And, Box::new(left), Box::new(right));
        }
        Ok(left)
    }

    fn relation(&mut self) -> Result<Expr, String> {
        let mut left = self.sum()?;
        loop {
            let op = match self.peek() {
                Token::Punct("==") => BinOp::Eq,
                Token::Punct("!=") => BinOp::Ne,
                Token::Punct("<") => BinOp::Lt,
                Token::Punct("<=") => BinOp::Le,
                Token::Punct(">") => BinOp::Gt,
                Token::Punct(">=") => BinOp::Ge,
                Token::Ident(w) if w == "in" => BinOp::In,
                _ => return Ok(left),
            };
            self.pos += 1;
            let right = self.sum()?;
            left = Expr::Binary(op, Box::new(left), Box::new(right));
        }
    }

    fn sum(&mut self) -> Result<Expr, String> {
        let mut left = self.unary()?;
        loop {
            let op = if self.eat("+") {
                BinOp::Add
            } else if self.eat("-") {
                BinOp::Sub
            } else {
                return Ok(left);
            };
            let right = self.unary()?;
            left = Expr::Binary(op, Box::new(left), Box::new(right));
        }
    }

    fn unary(&mut self) -> Result<Expr, String> {
        self.enter()?;
        let e = if self.eat("!") {
            self.unary().map(|e| Expr::Not(Box::new(e)))
        } else if self.eat("-") {
            self.unary().map(|e| Expr::Neg(Box::new(e)))
        } else {
            self.member()
        };
        self.nesting -= 1;
        e
    }

    fn member(&mut self) -> Result<Expr, String> {
        let mut e = self.primary()?;
        loop {
            if self.eat(".") {
                let at = self.offset();
                let Token::Ident(field) = self.next() else {
                    return Err(format!("expected a field name at offset {at}"));
                };
                if self.eat("(") {
                    e = self.method(e, field, at)?;
                } else {
                    e = Expr::Select(Box::new(e), field);
                }
            } else if self.eat("[") {
                let index = self.expr()?;
                self.expect("]")?;
                e = Expr::Index(Box::new(e), Box::new(index));
            } else {
                return Ok(e);
            }
        }
    }

    /// `target.name(` has been read.
    fn method(&mut self, target: Expr, name: String, at: usize) -> Result<Expr, String> {
        if name == "exists" || name == "all" {
            let var_at = self.offset();
            let Token::Ident(var) = self.next() else {
                return Err(format!(
                    "{name}() takes a variable name first, at offset {var_at}"
                ));
            };
            self.expect(",")?;
            let predicate = self.expr()?;
            self.expect(")")?;
            return Ok(Expr::Quantifier {
                target: Box::new(target),
                var,
                predicate: Box::new(predicate),
                all: name == "all",
            });
        }
        let args = self.args()?;
        if !matches!(
            name.as_str(),
            "size" | "startsWith" | "endsWith" | "contains"
        ) {
            return Err(format!("unsupported method {name}() at offset {at}"));
        }
        Ok(Expr::Call {
            target: Some(Box::new(target)),
            name,
            args,
        })
    }

    /// Arguments after `(`, through `)`.
    fn args(&mut self) -> Result<Vec<Expr>, String> {
        let mut args = Vec::new();
        if self.eat(")") {
            return Ok(args);
        }
        loop {
            args.push(self.expr()?);
            if self.eat(")") {
                return Ok(args);
            }
            self.expect(",")?;
        }
    }

    fn primary(&mut self) -> Result<Expr, String> {
        let at = self.offset();
        match self.next() {
            Token::Int(i) => Ok(Expr::Lit(Value::from(i))),
            Token::Float(x) => Ok(Expr::Lit(Value::from(x))),
            Token::Str(s) => Ok(Expr::Lit(Value::String(s))),
            Token::Punct("(") => {
                let e = self.expr()?;
                self.expect(")")?;
                Ok(e)
            }
            Token::Punct("[") => {
                let mut items = Vec::new();
                if !self.eat("]") {
                    loop {
                        items.push(self.expr()?);
                        if self.eat("]") {
                            break;
                        }
                        self.expect(",")?;
                    }
                }
                Ok(Expr::List(items))
            }
            Token::Ident(word) => match word.as_str() {
                "true" => Ok(Expr::Lit(Value::Bool(true))),
                "false" => Ok(Expr::Lit(Value::Bool(false))),
                "null" => Ok(Expr::Lit(Value::Null)),
                _ if self.eat("(") => self.function(word, at),
                _ => Ok(Expr::Ident(word)),
            },
            t => Err(format!("unexpected {t} at offset {at}")),
        }
    }

    /// `name(` has been read.
    fn function(&mut self, name: String, at: usize) -> Result<Expr, String> {
        match name.as_str() {
            "has" => {
                let arg = self.expr()?;
                self.expect(")")?;
                match arg {
                    Expr::Select(operand, field) => Ok(Expr::Has(operand, field)),
                    _ => Err(format!(
                        "has() takes a field selection such as has(a.b), at offset {at}"
                    )),
                }
            }
            "size" => Ok(Expr::Call {
                target: None,
                name,
                args: self.args()?,
            }),
            _ => Err(format!("unsupported function {name}() at offset {at}")),
        }
    }
}

/// A value while evaluating: borrowed from the variables where it is a
/// part of them (selecting a field copies nothing), owned where computed.
type Val<'v> = Cow<'v, Value>;

struct Scope<'v> {
    vars: &'v HashMap<&'v str, &'v Value>,
    /// Variables bound by macros, innermost last.
    bound: Vec<(&'v str, Val<'v>)>,
}

fn as_bool(v: &Value, what: &str) -> Result<bool, String> {
    v.as_bool()
        .ok_or_else(|| format!("no such overload: {what} applied to {}", type_name(v)))
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "bool",
        Value::Number(n) if n.is_f64() => "double",
        Value::Number(_) => "int",
        Value::String(_) => "string",
        Value::Array(_) => "list",
        Value::Object(_) => "map",
    }
}

/// CEL equality over JSON: numbers compare by value, values of different
/// types are unequal.
fn equal(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x.as_f64() == y.as_f64(),
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(a, b)| equal(a, b))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| equal(v, w)))
        }
        _ => a == b,
    }
}

fn order(a: &Value, b: &Value) -> Result<std::cmp::Ordering, String> {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => {
            let (x, y) = (
                x.as_f64().unwrap_or(f64::NAN),
                y.as_f64().unwrap_or(f64::NAN),
            );
            x.partial_cmp(&y)
                .ok_or_else(|| "cannot order NaN".to_owned())
        }
        (Value::String(x), Value::String(y)) => Ok(x.cmp(y)),
        (Value::Bool(x), Value::Bool(y)) => Ok(x.cmp(y)),
        _ => Err(format!(
            "no such overload: ordering {} and {}",
            type_name(a),
            type_name(b)
        )),
    }
}

/// The field `name` of a map (`None` when missing or null), borrowed from
/// a borrowed map; `Err` gives back a value that is not a map.
fn field<'v>(v: Val<'v>, name: &str) -> Result<Option<Val<'v>>, Val<'v>> {
    match v {
        Cow::Borrowed(Value::Object(map)) => {
            Ok(map.get(name).filter(|f| !f.is_null()).map(Cow::Borrowed))
        }
        Cow::Owned(Value::Object(mut map)) => {
            Ok(map.remove(name).filter(|f| !f.is_null()).map(Cow::Owned))
        }
        other => Err(other),
    }
}

impl<'v> Scope<'v> {
    fn lookup(&self, name: &str) -> Result<Val<'v>, String> {
        if let Some((_, v)) = self.bound.iter().rev().find(|(n, _)| *n == name) {
            return Ok(v.clone());
        }
        self.vars
            .get(name)
            .map(|v| Cow::Borrowed(*v))
            .ok_or_else(|| format!("undeclared reference to '{name}'"))
    }

    fn eval(&mut self, expr: &'v Expr) -> Result<Val<'v>, String> {
        let owned = |v: Value| Ok(Cow::Owned(v));
        match expr {
            Expr::Lit(v) => Ok(Cow::Borrowed(v)),
            Expr::Ident(name) => self.lookup(name),
            Expr::Select(operand, name) => match field(self.eval(operand)?, name) {
                Ok(Some(v)) => Ok(v),
                Ok(None) => Err(format!("no such key: {name}")),
                Err(other) => Err(format!(
                    "cannot select field '{name}' from {}",
                    type_name(&other)
                )),
            },
            Expr::Index(operand, index) => {
                let (container, index) = (self.eval(operand)?, self.eval(index)?);
                match (container, index.as_ref()) {
                    (map, Value::String(key)) if map.is_object() => field(map, key)
                        .ok()
                        .flatten()
                        .ok_or_else(|| format!("no such key: {key}")),
                    (Cow::Borrowed(Value::Array(list)), Value::Number(n)) => n
                        .as_u64()
                        .and_then(|i| list.get(usize::try_from(i).ok()?))
                        .map(Cow::Borrowed)
                        .ok_or_else(|| format!("index {n} out of range")),
                    (Cow::Owned(Value::Array(mut list)), Value::Number(n)) => n
                        .as_u64()
                        .and_then(|i| usize::try_from(i).ok())
                        .filter(|&i| i < list.len())
                        .map(|i| Cow::Owned(list.swap_remove(i)))
                        .ok_or_else(|| format!("index {n} out of range")),
                    (container, index) => Err(format!(
                        "no such overload: {}[{}]",
                        type_name(&container),
                        type_name(index)
                    )),
                }
            }
            Expr::List(items) => owned(Value::Array(
                items
                    .iter()
                    .map(|e| self.eval(e).map(Cow::into_owned))
                    .collect::<Result<_, _>>()?,
            )),
            Expr::Not(e) => owned(Value::Bool(!as_bool(self.eval(e)?.as_ref(), "!")?)),
            Expr::Neg(e) => match self.eval(e)?.as_ref() {
                Value::Number(n) => match n.as_i64() {
                    Some(i) => owned(Value::from(-i)),
                    None => owned(Value::from(-n.as_f64().unwrap_or(f64::NAN))),
                },
                other => Err(format!("no such overload: -{}", type_name(other))),
            },
            Expr::Logic(op, a, b) => self
                .logic(a, b, *op == Logic::Or)
                .map(|b| Cow::Owned(Value::Bool(b))),
            Expr::Binary(op, a, b) => {
                let (a, b) = (self.eval(a)?, self.eval(b)?);
                binary(*op, &a, &b).map(Cow::Owned)
            }
            Expr::Cond(cond, then, otherwise) => {
                if as_bool(self.eval(cond)?.as_ref(), "?:")? {
                    self.eval(then)
                } else {
                    self.eval(otherwise)
                }
            }
            Expr::Has(operand, name) => match field(self.eval(operand)?, name) {
                Ok(found) => owned(Value::Bool(found.is_some())),
                Err(other) => Err(format!(
                    "has() cannot test field '{name}' of {}",
                    type_name(&other)
                )),
            },
            Expr::Quantifier {
                target,
                var,
                predicate,
                all,
            } => {
                let items: Vec<Val<'v>> = match self.eval(target)? {
                    Cow::Borrowed(Value::Array(list)) => list.iter().map(Cow::Borrowed).collect(),
                    Cow::Owned(Value::Array(list)) => list.into_iter().map(Cow::Owned).collect(),
                    Cow::Borrowed(Value::Object(map)) => map
                        .keys()
                        .map(|k| Cow::Owned(Value::String(k.clone())))
                        .collect(),
                    Cow::Owned(Value::Object(map)) => map
                        .into_iter()
                        .map(|(k, _)| Cow::Owned(Value::String(k)))
                        .collect(),
                    other => {
                        return Err(format!(
                            "no such overload: {}() on {}",
                            if *all { "all" } else { "exists" },
                            type_name(&other)
                        ));
                    }
                };
                // Like `||` (exists) or `&&` (all) over the items: one
                // deciding item wins over another item's error.
                let mut error = None;
                for item in items {
                    self.bound.push((var.as_str(), item));
                    let result = self
                        .eval(predicate)
                        .and_then(|v| as_bool(&v, "a quantifier's predicate"));
                    self.bound.pop();
                    match result {
                        Ok(b) if b != *all => return owned(Value::Bool(b)),
                        Ok(_) => {}
                        Err(e) => error = Some(e),
                    }
                }
                match error {
                    Some(e) => Err(e),
                    None => owned(Value::Bool(*all)),
                }
            }
            Expr::Call { target, name, args } => {
                let mut values = Vec::with_capacity(args.len() + 1);
                if let Some(t) = target {
                    values.push(self.eval(t)?);
                }
                for a in args {
                    values.push(self.eval(a)?);
                }
                let values: Vec<&Value> = values.iter().map(AsRef::as_ref).collect();
                call(name, &values).map(Cow::Owned)
            }
        }
    }

    /// `a || b` (`or`) or `a && b`, with CEL's error absorption.
    fn logic(&mut self, a: &'v Expr, b: &'v Expr, or: bool) -> Result<bool, String> {
        let what = if or { "||" } else { "&&" };
        let left = self.eval(a).and_then(|v| as_bool(&v, what));
        if left == Ok(or) {
            return Ok(or);
        }
        let right = self.eval(b).and_then(|v| as_bool(&v, what));
        if right == Ok(or) {
            return Ok(or);
        }
        left?;
        right?;
        Ok(!or)
    }
}

fn binary(op: BinOp, a: &Value, b: &Value) -> Result<Value, String> {
    use std::cmp::Ordering::{Greater, Less};
    let result = match op {
        BinOp::Eq => equal(a, b),
        BinOp::Ne => !equal(a, b),
        BinOp::Lt => order(a, b)? == Less,
        BinOp::Le => order(a, b)? != Greater,
        BinOp::Gt => order(a, b)? == Greater,
        BinOp::Ge => order(a, b)? != Less,
        BinOp::In => match b {
            Value::Array(list) => list.iter().any(|v| equal(a, v)),
            Value::Object(map) => match a {
                Value::String(key) => map.contains_key(key),
                _ => false,
            },
            other => {
                return Err(format!("no such overload: in {}", type_name(other)));
            }
        },
        BinOp::Add => {
            return match (a, b) {
                (Value::Number(x), Value::Number(y)) => match (x.as_i64(), y.as_i64()) {
                    (Some(x), Some(y)) => x
                        .checked_add(y)
                        .map(Value::from)
                        .ok_or_else(|| "integer overflow".to_owned()),
                    _ => Ok(Value::from(
                        x.as_f64().unwrap_or(f64::NAN) + y.as_f64().unwrap_or(f64::NAN),
                    )),
                },
                (Value::String(x), Value::String(y)) => Ok(Value::String(format!("{x}{y}"))),
                (Value::Array(x), Value::Array(y)) => {
                    Ok(Value::Array(x.iter().chain(y).cloned().collect()))
                }
                _ => Err(format!(
                    "no such overload: {} + {}",
                    type_name(a),
                    type_name(b)
                )),
            };
        }
        BinOp::Sub => {
            return match (a, b) {
                (Value::Number(x), Value::Number(y)) => match (x.as_i64(), y.as_i64()) {
                    (Some(x), Some(y)) => x
                        .checked_sub(y)
                        .map(Value::from)
                        .ok_or_else(|| "integer overflow".to_owned()),
                    _ => Ok(Value::from(
                        x.as_f64().unwrap_or(f64::NAN) - y.as_f64().unwrap_or(f64::NAN),
                    )),
                },
                _ => Err(format!(
                    "no such overload: {} - {}",
                    type_name(a),
                    type_name(b)
                )),
            };
        }
    };
    Ok(Value::Bool(result))
}

fn call(name: &str, values: &[&Value]) -> Result<Value, String> {
    match (name, values) {
        ("size", [Value::String(s)]) => Ok(Value::from(s.chars().count())),
        ("size", [Value::Array(l)]) => Ok(Value::from(l.len())),
        ("size", [Value::Object(m)]) => Ok(Value::from(m.len())),
        ("startsWith", [Value::String(s), Value::String(p)]) => {
            Ok(Value::Bool(s.starts_with(p.as_str())))
        }
        ("endsWith", [Value::String(s), Value::String(p)]) => {
            Ok(Value::Bool(s.ends_with(p.as_str())))
        }
        ("contains", [Value::String(s), Value::String(p)]) => {
            Ok(Value::Bool(s.contains(p.as_str())))
        }
        _ => Err(format!(
            "no such overload: {name}({})",
            values
                .iter()
                .map(|v| type_name(v))
                .collect::<Vec<_>>()
                .join(", ")
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn run(source: &str, object: &Value, old: &Value, request: &Value) -> Result<Value, String> {
        let vars: HashMap<&str, &Value> =
            [("object", object), ("oldObject", old), ("request", request)].into();
        eval(&parse(source)?, &vars)
    }

    fn simple(source: &str) -> Result<Value, String> {
        run(source, &json!({}), &Value::Null, &json!({}))
    }

    #[test]
    fn literals_operators_and_precedence() {
        assert_eq!(simple("1 + 2 == 3"), Ok(json!(true)));
        assert_eq!(simple("'a' + \"b\" == 'ab'"), Ok(json!(true)));
        assert_eq!(simple("!true || false"), Ok(json!(false)));
        assert_eq!(simple("true || false && false"), Ok(json!(true)));
        assert_eq!(simple("false ? 1 : true ? 2 : 3"), Ok(json!(2)));
        assert_eq!(
            simple("1 < 2 && 2 <= 2 && 3 > 2 && 3 >= 4"),
            Ok(json!(false))
        );
        assert_eq!(simple("2 in [1, 2] && !(3 in [1, 2])"), Ok(json!(true)));
        assert_eq!(
            simple("-1 + 1 == 0 && 1.5 == 1.5 && 1 == 1.0"),
            Ok(json!(true))
        );
        assert_eq!(simple("'it\\'s' == \"it's\""), Ok(json!(true)));
        assert_eq!(
            simple("1 == 'a'"),
            Ok(json!(false)),
            "different types are unequal"
        );
        assert_eq!(simple("size('abc') + [1, 2].size() == 5"), Ok(json!(true)));
        assert_eq!(
            simple(
                "'gpupool.io/x'.startsWith('gpupool.io/') && 'ab'.endsWith('b') && 'abc'.contains('b')"
            ),
            Ok(json!(true))
        );
    }

    #[test]
    fn fields_indexes_has_and_macros_over_json() {
        let object = json!({"metadata": {"labels": {"a": "1"}, "annotations": null},
            "spec": {"gates": [{"name": "x"}, {"name": "y"}]}});
        let eval = |s: &str| run(s, &object, &Value::Null, &json!({}));
        assert_eq!(eval("object.metadata.labels['a'] == '1'"), Ok(json!(true)));
        assert_eq!(eval("'a' in object.metadata.labels"), Ok(json!(true)));
        assert_eq!(eval("has(object.metadata.labels)"), Ok(json!(true)));
        assert_eq!(
            eval("has(object.metadata.annotations)"),
            Ok(json!(false)),
            "null is absent"
        );
        assert_eq!(eval("has(object.status)"), Ok(json!(false)));
        assert_eq!(
            eval("object.spec.gates.exists(g, g.name == 'y')"),
            Ok(json!(true))
        );
        assert_eq!(
            eval("object.spec.gates.all(g, g.name == 'y')"),
            Ok(json!(false))
        );
        assert_eq!(eval("object.spec.gates[1].name"), Ok(json!("y")));
        assert_eq!(
            eval("object.metadata.labels.exists(k, k == 'a')"),
            Ok(json!(true))
        );
    }

    #[test]
    fn errors_name_the_problem_and_logic_absorbs_them_like_cel() {
        let object = json!({"metadata": {}});
        let eval = |s: &str| run(s, &object, &Value::Null, &json!({}));
        assert_eq!(
            eval("object.metadata.labels['a'] == '1'"),
            Err("no such key: labels".into())
        );
        assert_eq!(
            eval("nobody == 1"),
            Err("undeclared reference to 'nobody'".into())
        );
        assert_eq!(
            eval("has(oldObject.spec)"),
            Err("has() cannot test field 'spec' of null".into())
        );
        // One side alone decides: the other side's error does not matter.
        assert_eq!(
            eval("object.metadata.labels.x == 'a' || true"),
            Ok(json!(true))
        );
        assert_eq!(
            eval("false && object.metadata.labels.x == 'a'"),
            Ok(json!(false))
        );
        assert_eq!(
            eval("true && object.metadata.labels.x == 'a'"),
            Err("no such key: labels".into())
        );
        assert_eq!(
            eval("1 ? 2 : 3"),
            Err("no such overload: ?: applied to int".into())
        );
        assert_eq!(
            eval("!'a'"),
            Err("no such overload: ! applied to string".into())
        );
    }

    #[test]
    fn parse_errors_say_what_and_where() {
        for (source, error) in [
            ("a ==", "unexpected end of expression at offset 4"),
            ("(a", "expected ')' but found end of expression at offset 2"),
            ("'open", "unterminated string at offset 0"),
            ("a # b", "unexpected character '#' at offset 2"),
            (
                "matches(a, 'x')",
                "unsupported function matches() at offset 0",
            ),
            ("a.b.map(x, x)", "unsupported method map() at offset 4"),
            (
                "has(a)",
                "has() takes a field selection such as has(a.b), at offset 0",
            ),
            ("a b", "unexpected 'b' at offset 2"),
        ] {
            assert_eq!(parse(source).expect_err(source), error, "{source}");
        }
    }

    /// Whoever writes a webhook configuration cannot make the server
    /// exhaust its stack or its time on one expression.
    #[test]
    fn expressions_too_deep_or_too_long_are_refused() {
        let parens = format!("{}true{}", "(".repeat(1_000), ")".repeat(1_000));
        assert!(
            parse(&parens)
                .expect_err("too deep")
                .starts_with("the expression nests more than 128 levels deep at offset "),
        );
        let nots = format!("{}true", "!".repeat(1_000));
        assert!(
            parse(&nots)
                .expect_err("too deep")
                .contains("more than 128 levels")
        );
        let chain = vec!["true"; 300].join(" || ");
        assert_eq!(
            parse(&chain).expect_err("too deep"),
            "the expression nests more than 256 levels deep"
        );
        let long = vec!["1"; 5000].join(" + ");
        assert_eq!(
            parse(&long).expect_err("too long"),
            "the expression is longer than 4096 tokens"
        );
        // The deepest allowed is evaluated in full on a test thread's stack.
        let deepest = vec!["false"; 256].join(" || ");
        assert_eq!(simple(&deepest), Ok(json!(false)));
    }

    /// The expressions the operator's own webhook configurations carry.
    #[test]
    fn the_operators_conditions() {
        let not_the_operator = "!(request.userInfo.username in ['system:serviceaccount:gpupool-system:gpupool-operator', 'o\\'brien'])";
        let request = |user: &str| json!({"userInfo": {"username": user}});
        let obj = json!({});
        assert_eq!(
            run(
                not_the_operator,
                &obj,
                &Value::Null,
                &request("system:serviceaccount:gpupool-system:gpupool-operator")
            ),
            Ok(json!(false))
        );
        assert_eq!(
            run(not_the_operator, &obj, &Value::Null, &request("o'brien")),
            Ok(json!(false))
        );
        assert_eq!(
            run(not_the_operator, &obj, &Value::Null, &request("alice")),
            Ok(json!(true))
        );

        let guarded = concat!(
            "(has(oldObject.spec.schedulingGates) && oldObject.spec.schedulingGates.exists(g, g.name == 'gpupool.io/admission'))",
            " || (has(oldObject.metadata.labels) && 'gpupool.io/class' in oldObject.metadata.labels ? oldObject.metadata.labels['gpupool.io/class'] : '')",
            " != (has(object.metadata.labels) && 'gpupool.io/class' in object.metadata.labels ? object.metadata.labels['gpupool.io/class'] : '')",
        );
        let pod = |gates: Value, class: Option<&str>| {
            let mut p = json!({"metadata": {}, "spec": {"containers": []}});
            if !gates.is_null() {
                p["spec"]["schedulingGates"] = gates;
            }
            if let Some(c) = class {
                p["metadata"]["labels"] = json!({"gpupool.io/class": c});
            }
            p
        };
        let gated = json!([{"name": "gpupool.io/admission"}]);
        let r = json!({});
        assert_eq!(
            run(
                guarded,
                &pod(Value::Null, Some("a")),
                &pod(gated.clone(), Some("a")),
                &r
            ),
            Ok(json!(true))
        );
        assert_eq!(
            run(
                guarded,
                &pod(Value::Null, Some("a")),
                &pod(Value::Null, Some("a")),
                &r
            ),
            Ok(json!(false))
        );
        assert_eq!(
            run(
                guarded,
                &pod(Value::Null, Some("b")),
                &pod(Value::Null, Some("a")),
                &r
            ),
            Ok(json!(true))
        );
        assert_eq!(
            run(
                guarded,
                &pod(Value::Null, None),
                &pod(Value::Null, Some("a")),
                &r
            ),
            Ok(json!(true))
        );
        assert_eq!(
            run(
                guarded,
                &pod(json!([{"name": "other"}]), None),
                &pod(json!([{"name": "other"}]), None),
                &r
            ),
            Ok(json!(false))
        );
    }
}
