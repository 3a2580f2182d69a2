//! A small HPACK codec (RFC 7541, header compression for HTTP/2): it decodes
//! any header block a peer sends (static and dynamic table, Huffman strings,
//! table size updates) and encodes fields without touching the peer's
//! dynamic table, so that a block can be re-encoded on its way through.

use std::collections::VecDeque;

/// Dynamic table size every HTTP/2 connection starts with.
pub const DEFAULT_TABLE_SIZE: usize = 4096;

/// Largest dynamic table a peer may ask the decoder for. A peer may only go
/// up to what the receiving server advertised (4,096 bytes unless it says
/// otherwise); the slack is harmless and the bound keeps memory small.
pub const MAX_TABLE_SIZE: usize = 64 * 1024;

/// Per-entry overhead the table size counts (RFC 7541 §4.1).
const ENTRY_OVERHEAD: usize = 32;

/// One header field: name and value as bytes.
pub type Field = (Vec<u8>, Vec<u8>);

/// Why a header block could not be decoded.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum HpackError {
    /// The block ends in the middle of a representation.
    #[error("header block is truncated")]
    Truncated,
    /// An integer does not fit.
    #[error("integer overflows")]
    IntegerOverflow,
    /// An index names no table entry.
    #[error("index {0} names no table entry")]
    BadIndex(usize),
    /// A Huffman string is malformed (bad padding, or the EOS symbol).
    #[error("malformed Huffman string")]
    BadHuffman,
    /// A dynamic table size update is above [`MAX_TABLE_SIZE`].
    #[error("dynamic table size {0} is too large")]
    TableTooLarge(usize),
}

/// The static table (RFC 7541 Appendix A), indices 1 to 61.
const STATIC_TABLE: [(&str, &str); 61] = [
    (":authority", ""),
    (":method", "GET"),
    (":method", "POST"),
    (":path", "/"),
    (":path", "/index.html"),
    (":scheme", "http"),
    (":scheme", "https"),
    (":status", "200"),
    (":status", "204"),
    (":status", "206"),
    (":status", "304"),
    (":status", "400"),
    (":status", "404"),
    (":status", "500"),
    ("accept-charset", ""),
    ("accept-encoding", "gzip, deflate"),
    ("accept-language", ""),
    ("accept-ranges", ""),
    ("accept", ""),
    ("access-control-allow-origin", ""),
    ("age", ""),
    ("allow", ""),
    ("authorization", ""),
    ("cache-control", ""),
    ("content-disposition", ""),
    ("content-encoding", ""),
    ("content-language", ""),
    ("content-length", ""),
    ("content-location", ""),
    ("content-range", ""),
    ("content-type", ""),
    ("cookie", ""),
    ("date", ""),
    ("etag", ""),
    ("expect", ""),
    ("expires", ""),
    ("from", ""),
    ("host", ""),
    ("if-match", ""),
    ("if-modified-since", ""),
    ("if-none-match", ""),
    ("if-range", ""),
    ("if-unmodified-since", ""),
    ("last-modified", ""),
    ("link", ""),
    ("location", ""),
    ("max-forwards", ""),
    ("proxy-authenticate", ""),
    ("proxy-authorization", ""),
    ("range", ""),
    ("referer", ""),
    ("refresh", ""),
    ("retry-after", ""),
    ("server", ""),
    ("set-cookie", ""),
    ("strict-transport-security", ""),
    ("transfer-encoding", ""),
    ("user-agent", ""),
    ("vary", ""),
    ("via", ""),
    ("www-authenticate", ""),
];

/// Code length of each symbol (bytes 0 to 255, then EOS) of the HPACK
/// Huffman code (RFC 7541 Appendix B). The code is canonical, so the codes
/// themselves follow from the lengths (see [`Huffman::build`]).
const CODE_LENGTHS: [u8; 257] = [
    13, 23, 28, 28, 28, 28, 28, 28, 28, 24, 30, 28, 28, 30, 28, 28, 28, 28, 28, 28, 28, 28, 30, 28,
    28, 28, 28, 28, 28, 28, 28, 28, 6, 10, 10, 12, 13, 6, 8, 11, 10, 10, 8, 11, 8, 6, 6, 6, 5, 5,
    5, 6, 6, 6, 6, 6, 6, 6, 7, 8, 15, 6, 12, 10, 13, 6, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7,
    7, 7, 7, 7, 7, 7, 7, 7, 8, 7, 8, 13, 19, 13, 14, 6, 15, 5, 6, 5, 6, 5, 6, 6, 6, 5, 7, 7, 6, 6,
    6, 5, 6, 7, 6, 5, 5, 6, 7, 7, 7, 7, 7, 15, 11, 14, 13, 28, 20, 22, 20, 20, 22, 22, 22, 23, 22,
    23, 23, 23, 23, 23, 24, 23, 24, 24, 22, 23, 24, 23, 23, 23, 23, 21, 22, 23, 22, 23, 23, 24, 22,
    21, 20, 22, 22, 23, 23, 21, 23, 22, 22, 24, 21, 22, 23, 23, 21, 21, 22, 21, 23, 22, 23, 23, 20,
    22, 22, 22, 23, 22, 22, 23, 26, 26, 20, 19, 22, 23, 22, 25, 26, 26, 26, 27, 27, 26, 24, 25, 19,
    21, 26, 27, 27, 26, 27, 24, 21, 21, 26, 26, 28, 27, 27, 27, 20, 24, 20, 21, 22, 21, 21, 23, 22,
    22, 25, 25, 24, 24, 26, 23, 26, 27, 26, 26, 27, 27, 27, 27, 27, 28, 27, 27, 27, 27, 27, 26, 30,
];

/// The end-of-string symbol, which must never appear in a string.
const EOS: u16 = 256;
/// Longest code.
const MAX_CODE_LEN: usize = 30;

/// The canonical Huffman code, built at compile time from [`CODE_LENGTHS`].
struct Huffman {
    /// Code of each symbol (right-aligned).
    codes: [u32; 257],
    /// First code of each length.
    first: [u32; MAX_CODE_LEN + 1],
    /// Number of codes of each length.
    count: [u16; MAX_CODE_LEN + 1],
    /// Where each length's symbols start in `symbols`.
    offset: [u16; MAX_CODE_LEN + 1],
    /// Symbols ordered by (code length, symbol), i.e. by code.
    symbols: [u16; 257],
}

impl Huffman {
    /// Assigns codes canonically: shorter codes first, and within one
    /// length in symbol order, each one more than the last.
    const fn build() -> Huffman {
        let mut table = Huffman {
            codes: [0; 257],
            first: [0; MAX_CODE_LEN + 1],
            count: [0; MAX_CODE_LEN + 1],
            offset: [0; MAX_CODE_LEN + 1],
            symbols: [0; 257],
        };
        let mut code: u32 = 0;
        let mut placed: u16 = 0;
        let mut len = 1;
        while len <= MAX_CODE_LEN {
            table.first[len] = code;
            table.offset[len] = placed;
            let mut symbol = 0;
            while symbol < 257 {
                if CODE_LENGTHS[symbol] as usize == len {
                    table.codes[symbol] = code;
                    table.symbols[placed as usize] = symbol as u16;
                    table.count[len] += 1;
                    placed += 1;
                    code += 1;
                }
                symbol += 1;
            }
            code <<= 1;
            len += 1;
        }
        table
    }
}

static HUFFMAN: Huffman = Huffman::build();

/// Huffman-encodes `text`, padding the last byte with ones.
pub fn huffman_encode(text: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len());
    let mut bits: u64 = 0;
    let mut pending: u32 = 0;
    for byte in text {
        let len = u32::from(CODE_LENGTHS[usize::from(*byte)]);
        bits = (bits << len) | u64::from(HUFFMAN.codes[usize::from(*byte)]);
        pending += len;
        while pending >= 8 {
            pending -= 8;
            out.push((bits >> pending) as u8);
        }
        bits &= (1 << pending) - 1;
    }
    if pending > 0 {
        let pad = 8 - pending;
        out.push(((bits << pad) | ((1 << pad) - 1)) as u8);
    }
    out
}

/// Decodes a Huffman string. Padding must be at most 7 one bits (a prefix
/// of EOS), and EOS itself must not appear.
pub fn huffman_decode(bytes: &[u8]) -> Result<Vec<u8>, HpackError> {
    let mut out = Vec::with_capacity(bytes.len() * 8 / 5);
    let mut code: u32 = 0;
    let mut len: usize = 0;
    for byte in bytes {
        for shift in (0..8).rev() {
            code = (code << 1) | u32::from((byte >> shift) & 1);
            len += 1;
            if len > MAX_CODE_LEN {
                return Err(HpackError::BadHuffman);
            }
            let first = HUFFMAN.first[len];
            let count = u32::from(HUFFMAN.count[len]);
            if code >= first && code - first < count {
                let at = usize::from(HUFFMAN.offset[len]) + (code - first) as usize;
                let symbol = HUFFMAN.symbols[at];
                if symbol == EOS {
                    return Err(HpackError::BadHuffman);
                }
                out.push(symbol as u8);
                code = 0;
                len = 0;
            }
        }
    }
    if len > 7 || code != (1 << len) - 1 {
        return Err(HpackError::BadHuffman);
    }
    Ok(out)
}

/// Appends `value` as an HPACK integer with an `prefix_bits`-bit prefix;
/// `flags` are the bits of the first byte above the prefix.
pub fn encode_integer(out: &mut Vec<u8>, prefix_bits: u8, flags: u8, value: usize) {
    let max = (1usize << prefix_bits) - 1;
    if value < max {
        out.push(flags | value as u8);
        return;
    }
    out.push(flags | max as u8);
    let mut rest = value - max;
    while rest >= 128 {
        out.push((rest % 128) as u8 | 0x80);
        rest /= 128;
    }
    out.push(rest as u8);
}

/// Appends a string literal, Huffman-encoded if `huffman`.
pub fn encode_string(out: &mut Vec<u8>, text: &[u8], huffman: bool) {
    if huffman {
        let coded = huffman_encode(text);
        encode_integer(out, 7, 0x80, coded.len());
        out.extend_from_slice(&coded);
    } else {
        encode_integer(out, 7, 0, text.len());
        out.extend_from_slice(text);
    }
}

/// Encodes `fields` as a header block that leaves the receiver's dynamic
/// table untouched: exact static-table matches as indices, everything else
/// as literals without indexing (with a static name index when there is
/// one). The receiver's table stays empty, so blocks can be encoded in any
/// order without shared state.
pub fn encode_block(fields: &[Field]) -> Vec<u8> {
    let mut out = Vec::with_capacity(fields.iter().map(|(n, v)| n.len() + v.len() + 3).sum());
    for (name, value) in fields {
        let mut name_index = 0;
        let mut exact = 0;
        for (i, (static_name, static_value)) in STATIC_TABLE.iter().enumerate() {
            if static_name.as_bytes() == name.as_slice() {
                if name_index == 0 {
                    name_index = i + 1;
                }
                if static_value.as_bytes() == value.as_slice() {
                    exact = i + 1;
                    break;
                }
            }
        }
        if exact != 0 {
            encode_integer(&mut out, 7, 0x80, exact);
            continue;
        }
        encode_integer(&mut out, 4, 0x00, name_index);
        if name_index == 0 {
            encode_string(&mut out, name, false);
        }
        encode_string(&mut out, value, false);
    }
    out
}

/// Reads representations off a header block.
struct Reader<'a> {
    block: &'a [u8],
    pos: usize,
}

impl Reader<'_> {
    fn byte(&mut self) -> Result<u8, HpackError> {
        let byte = *self.block.get(self.pos).ok_or(HpackError::Truncated)?;
        self.pos += 1;
        Ok(byte)
    }

    fn integer(&mut self, prefix_bits: u8) -> Result<usize, HpackError> {
        let max = (1usize << prefix_bits) - 1;
        let first = usize::from(self.byte()?) & max;
        if first < max {
            return Ok(first);
        }
        let mut value = max;
        let mut shift = 0u32;
        loop {
            let byte = self.byte()?;
            let part = usize::from(byte & 0x7f)
                .checked_shl(shift)
                .filter(|_| shift <= 28)
                .ok_or(HpackError::IntegerOverflow)?;
            value = value.checked_add(part).ok_or(HpackError::IntegerOverflow)?;
            if byte & 0x80 == 0 {
                return Ok(value);
            }
            shift += 7;
        }
    }

    fn string(&mut self) -> Result<Vec<u8>, HpackError> {
        let huffman = self
            .block
            .get(self.pos)
            .is_some_and(|byte| byte & 0x80 != 0);
        let len = self.integer(7)?;
        let end = self
            .pos
            .checked_add(len)
            .filter(|end| *end <= self.block.len())
            .ok_or(HpackError::Truncated)?;
        let raw = &self.block[self.pos..end];
        self.pos = end;
        if huffman {
            huffman_decode(raw)
        } else {
            Ok(raw.to_vec())
        }
    }
}

/// The decoding side of one connection's header compression: its dynamic
/// table persists from block to block, so every block of the connection
/// must go through the same decoder, in order.
#[derive(Debug)]
pub struct Decoder {
    table: VecDeque<Field>,
    size: usize,
    max_size: usize,
}

impl Default for Decoder {
    fn default() -> Self {
        Decoder::new()
    }
}

impl Decoder {
    /// A decoder with the default 4,096-byte dynamic table.
    pub fn new() -> Self {
        Decoder {
            table: VecDeque::new(),
            size: 0,
            max_size: DEFAULT_TABLE_SIZE,
        }
    }

    /// Decodes one complete header block into its fields, in order.
    pub fn decode(&mut self, block: &[u8]) -> Result<Vec<Field>, HpackError> {
        let mut reader = Reader { block, pos: 0 };
        let mut fields = Vec::new();
        while reader.pos < block.len() {
            let first = block[reader.pos];
            if first & 0x80 != 0 {
                let index = reader.integer(7)?;
                fields.push(self.entry(index)?);
            } else if first & 0x40 != 0 {
                let field = self.literal(&mut reader, 6)?;
                self.insert(field.clone());
                fields.push(field);
            } else if first & 0x20 != 0 {
                let size = reader.integer(5)?;
                if size > MAX_TABLE_SIZE {
                    return Err(HpackError::TableTooLarge(size));
                }
                self.max_size = size;
                self.evict(0);
            } else {
                // Without indexing (0000) or never indexed (0001).
                fields.push(self.literal(&mut reader, 4)?);
            }
        }
        Ok(fields)
    }

    fn literal(&self, reader: &mut Reader<'_>, prefix_bits: u8) -> Result<Field, HpackError> {
        let index = reader.integer(prefix_bits)?;
        let name = if index == 0 {
            reader.string()?
        } else {
            self.entry(index)?.0
        };
        Ok((name, reader.string()?))
    }

    fn entry(&self, index: usize) -> Result<Field, HpackError> {
        if let Some((name, value)) = index.checked_sub(1).and_then(|i| STATIC_TABLE.get(i)) {
            return Ok((name.as_bytes().to_vec(), value.as_bytes().to_vec()));
        }
        index
            .checked_sub(STATIC_TABLE.len() + 1)
            .and_then(|i| self.table.get(i))
            .cloned()
            .ok_or(HpackError::BadIndex(index))
    }

    /// Drops the oldest entries until `incoming` more bytes fit.
    fn evict(&mut self, incoming: usize) {
        while self.size + incoming > self.max_size {
            let Some((name, value)) = self.table.pop_back() else {
                break;
            };
            self.size -= name.len() + value.len() + ENTRY_OVERHEAD;
        }
    }

    fn insert(&mut self, field: Field) {
        let size = field.0.len() + field.1.len() + ENTRY_OVERHEAD;
        self.evict(size);
        // An entry larger than the whole table empties it and is not kept.
        if size <= self.max_size {
            self.size += size;
            self.table.push_front(field);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(text: &str) -> Vec<u8> {
        let digits: Vec<u8> = text.bytes().filter(u8::is_ascii_hexdigit).collect();
        digits
            .chunks(2)
            .map(|pair| {
                u8::from_str_radix(std::str::from_utf8(pair).expect("ascii"), 16).expect("hex")
            })
            .collect()
    }

    fn fields(list: &[(&str, &str)]) -> Vec<Field> {
        list.iter()
            .map(|(n, v)| (n.as_bytes().to_vec(), v.as_bytes().to_vec()))
            .collect()
    }

    #[test]
    fn the_code_is_the_rfc_code() {
        // Spot checks against RFC 7541 Appendix B.
        for (symbol, code, len) in [
            (b'0' as usize, 0x0, 5),
            (b'a' as usize, 0x3, 5),
            (b' ' as usize, 0x14, 6),
            (b'/' as usize, 0x18, 6),
            (0, 0x1ff8, 13),
            (255, 0x3ffffee, 26),
            (256, 0x3fffffff, 30),
        ] {
            assert_eq!(HUFFMAN.codes[symbol], code, "symbol {symbol}");
            assert_eq!(usize::from(CODE_LENGTHS[symbol]), len, "symbol {symbol}");
        }
        // Kraft equality: a complete prefix code.
        let kraft: u64 = CODE_LENGTHS.iter().map(|l| 1u64 << (30 - l)).sum();
        assert_eq!(kraft, 1 << 30);
    }

    #[test]
    fn huffman_round_trips_every_byte() {
        let all: Vec<u8> = (0..=255).collect();
        assert_eq!(huffman_decode(&huffman_encode(&all)), Ok(all));
        assert_eq!(
            huffman_encode(b"www.example.com"),
            hex("f1e3 c2e5 f23a 6ba0 ab90 f4ff")
        );
        assert_eq!(
            huffman_decode(&hex("a8eb 1064 9cbf")),
            Ok(b"no-cache".to_vec())
        );
    }

    #[test]
    fn huffman_rejects_bad_padding_and_eos() {
        // '0' is 00000: padding with zeros, or 8+ bits of padding, is wrong.
        assert_eq!(huffman_decode(&[0x00]), Err(HpackError::BadHuffman));
        assert_eq!(huffman_decode(&[0x07]), Ok(b"0".to_vec()));
        assert_eq!(huffman_decode(&[0x07, 0xff]), Err(HpackError::BadHuffman));
        assert_eq!(
            huffman_decode(&[0xff, 0xff, 0xff, 0xff]),
            Err(HpackError::BadHuffman)
        );
    }

    #[test]
    fn decodes_the_rfc_request_examples_with_huffman() {
        // RFC 7541 C.4: three requests on one connection sharing the table.
        let mut decoder = Decoder::new();
        let blocks = [
            (
                "8286 8441 8cf1 e3c2 e5f2 3a6b a0ab 90f4 ff",
                &[
                    (":method", "GET"),
                    (":scheme", "http"),
                    (":path", "/"),
                    (":authority", "www.example.com"),
                ][..],
            ),
            (
                "8286 84be 5886 a8eb 1064 9cbf",
                &[
                    (":method", "GET"),
                    (":scheme", "http"),
                    (":path", "/"),
                    (":authority", "www.example.com"),
                    ("cache-control", "no-cache"),
                ][..],
            ),
            (
                "8287 85bf 4088 25a8 49e9 5ba9 7d7f 8925 a849 e95b b8e8 b4bf",
                &[
                    (":method", "GET"),
                    (":scheme", "https"),
                    (":path", "/index.html"),
                    (":authority", "www.example.com"),
                    ("custom-key", "custom-value"),
                ][..],
            ),
        ];
        for (block, want) in blocks {
            assert_eq!(decoder.decode(&hex(block)), Ok(fields(want)), "{block}");
        }
        assert_eq!(decoder.size, 164, "table size after C.4.3");
    }

    #[test]
    fn decodes_the_rfc_examples_without_huffman() {
        // RFC 7541 C.3.1, and C.2.2 (without indexing) / C.2.3 (never indexed).
        let mut decoder = Decoder::new();
        let block = hex("8286 8441 0f77 7777 2e65 7861 6d70 6c65 2e63 6f6d");
        assert_eq!(
            decoder.decode(&block),
            Ok(fields(&[
                (":method", "GET"),
                (":scheme", "http"),
                (":path", "/"),
                (":authority", "www.example.com")
            ]))
        );
        let block = hex("040c 2f73 616d 706c 652f 7061 7468");
        assert_eq!(
            decoder.decode(&block),
            Ok(fields(&[(":path", "/sample/path")]))
        );
        let block = hex("1008 7061 7373 776f 7264 0673 6563 7265 74");
        assert_eq!(
            decoder.decode(&block),
            Ok(fields(&[("password", "secret")]))
        );
    }

    #[test]
    fn table_size_updates_evict() {
        let mut decoder = Decoder::new();
        let mut block = Vec::new();
        encode_integer(&mut block, 6, 0x40, 0);
        encode_string(&mut block, b"k", false);
        encode_string(&mut block, b"v", true);
        decoder.decode(&block).expect("insert");
        assert_eq!(decoder.decode(&[0xbe]), Ok(fields(&[("k", "v")])));
        // Size 0 empties the table; the entry is gone.
        assert_eq!(decoder.decode(&[0x20]), Ok(Vec::new()));
        assert_eq!(decoder.decode(&[0xbe]), Err(HpackError::BadIndex(62)));
        let mut too_big = Vec::new();
        encode_integer(&mut too_big, 5, 0x20, MAX_TABLE_SIZE + 1);
        assert_eq!(
            decoder.decode(&too_big),
            Err(HpackError::TableTooLarge(MAX_TABLE_SIZE + 1))
        );
    }

    #[test]
    fn malformed_blocks_are_errors() {
        let mut decoder = Decoder::new();
        let cases: [(&[u8], HpackError); 5] = [
            (&[0x80], HpackError::BadIndex(0)),
            (&[0xff, 0x00], HpackError::BadIndex(127)),
            (&[0x40, 0x05, b'a'], HpackError::Truncated),
            (&[0x7f], HpackError::Truncated),
            (
                &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f],
                HpackError::IntegerOverflow,
            ),
        ];
        for (block, want) in cases {
            assert_eq!(decoder.decode(block), Err(want), "{block:?}");
        }
    }

    #[test]
    fn encoded_blocks_decode_to_the_same_fields_and_leave_the_table_empty() {
        let list = fields(&[
            (":method", "POST"),
            (":scheme", "http"),
            (":path", "/v1beta1.DevicePlugin/Allocate"),
            (":authority", "localhost"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
            ("x-long", &"v".repeat(300)),
        ]);
        let block = encode_block(&list);
        let mut decoder = Decoder::new();
        assert_eq!(decoder.decode(&block), Ok(list));
        assert!(decoder.table.is_empty());
        assert_eq!(
            &block[..2],
            &[0x83, 0x86],
            "exact static matches are indices"
        );
    }
}
