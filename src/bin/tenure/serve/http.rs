//! Requests in, replies out: query and form fields, and the headers every reply carries.

use maud::Markup;

use super::server::Request;

/// Headers on every reply: no script, style or frame from anywhere else, no framing of
/// these pages, no sniffing, no referrer to other sites, no caching (the pages show live
/// data).
pub const SECURITY_HEADERS: &[(&str, &str)] = &[
    (
        "Content-Security-Policy",
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; \
         form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    ),
    ("X-Frame-Options", "DENY"),
    ("X-Content-Type-Options", "nosniff"),
    // Not `no-referrer`: under it Chromium posts a form to its own site with `Origin: null`,
    // which the action check must refuse (sandboxed frames send it too).
    ("Referrer-Policy", "same-origin"),
    ("Cache-Control", "no-store"),
    ("Cross-Origin-Opener-Policy", "same-origin"),
    ("Cross-Origin-Resource-Policy", "same-origin"),
];

/// A reply before it is sent.
pub struct Reply {
    pub status: u16,
    pub content_type: &'static str,
    pub body: Vec<u8>,
    pub headers: Vec<(&'static str, String)>,
}

impl Reply {
    /// An HTML page.
    pub fn html(status: u16, markup: Markup) -> Reply {
        Reply {
            status,
            content_type: "text/html; charset=utf-8",
            body: markup.into_string().into_bytes(),
            headers: Vec::new(),
        }
    }

    /// An embedded asset.
    pub fn asset(content_type: &'static str, body: &'static str) -> Reply {
        Reply {
            status: 200,
            content_type,
            body: body.as_bytes().to_vec(),
            headers: Vec::new(),
        }
    }

    /// "See other": where a browser goes after an action (so a reload does not repeat it).
    pub fn see_other(location: String) -> Reply {
        Reply {
            status: 303,
            content_type: "text/plain; charset=utf-8",
            body: Vec::new(),
            headers: vec![("Location", location)],
        }
    }

    /// A plain-text refusal.
    pub fn text(status: u16, text: &str) -> Reply {
        Reply {
            status,
            content_type: "text/plain; charset=utf-8",
            body: format!("{text}\n").into_bytes(),
            headers: Vec::new(),
        }
    }
}

/// A request's method, path and fields (query string, or form body for a POST).
pub struct Incoming {
    pub post: bool,
    pub path: String,
    pub fields: Vec<(String, String)>,
}

impl Incoming {
    /// What a handler needs of `request`: the fields of a POST's form body, else of the
    /// query string. A POST whose body is not a form is refused.
    pub fn read(request: &Request) -> Result<Incoming, Reply> {
        let post = request.method == "POST";
        let (path, query) = request
            .target
            .split_once('?')
            .unwrap_or((&request.target, ""));
        let fields = if post {
            let is_form = request.header("Content-Type").is_some_and(|value| {
                value.split(';').next().is_some_and(|kind| {
                    kind.trim()
                        .eq_ignore_ascii_case("application/x-www-form-urlencoded")
                })
            });
            if !is_form {
                return Err(Reply::text(415, "an action is an HTML form post"));
            }
            parse(&request.body)
        } else {
            parse(query.as_bytes())
        };
        Ok(Incoming {
            post,
            path: path.to_string(),
            fields,
        })
    }

    /// The first value of field `name`, if given and not empty.
    pub fn field(&self, name: &str) -> Option<&str> {
        self.fields
            .iter()
            .find(|(key, value)| key == name && !value.is_empty())
            .map(|(_, value)| value.as_str())
    }
}

fn parse(bytes: &[u8]) -> Vec<(String, String)> {
    form_urlencoded::parse(bytes).into_owned().collect()
}

/// `path?name=value&...`, each value encoded.
pub fn link(path: &str, fields: &[(&str, &str)]) -> String {
    let fields: Vec<_> = fields
        .iter()
        .filter(|(_, value)| !value.is_empty())
        .collect();
    if fields.is_empty() {
        return path.to_string();
    }
    let mut query = form_urlencoded::Serializer::new(String::new());
    for (name, value) in fields {
        query.append_pair(name, value);
    }
    format!("{path}?{}", query.finish())
}
