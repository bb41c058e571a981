//! Chat templates: Hugging Face Jinja templates rendered with minijinja.
//!
//! The environment mirrors how transformers renders them: `trim_blocks` and `lstrip_blocks`,
//! loop controls, Python string methods (`pycompat`), `raise_exception` and `strftime_now`.

use minijinja::syntax::SyntaxConfig;
use minijinja::value::Serde;
use minijinja::{context, Environment, Error, ErrorKind};
use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};
use crate::tokenizer::TextTokenizer;

/// One chat message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Self {
        Self {
            role: role.to_string(),
            content: content.to_string(),
        }
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ChatTemplate")
    }
}

const NAME: &str = "chat";

impl ChatTemplate {
    /// Compiles `source`; `bos_token`/`eos_token` are the strings templates may reference.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| ModelError::Template(e.to_string()))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, Error> {
                Err(Error::new(ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_function("strftime_now", |fmt: String| -> String {
            strftime_now(&fmt)
        });
        env.add_template_owned(NAME, source.to_string())
            .map_err(|e| ModelError::Template(format!("cannot compile: {e}")))?;
        Ok(Self {
            env,
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        })
    }

    /// Renders `messages`, ending with the assistant prompt when `add_generation_prompt`.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let tmpl = self
            .env
            .get_template(NAME)
            .map_err(|e| ModelError::Template(e.to_string()))?;
        tmpl.render(context! {
            messages => minijinja::Value::from(Serde(messages)),
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        })
        .map_err(|e| ModelError::Template(format!("cannot render: {e}")))
    }
}

/// Token ids for a conversation: through the chat template unless `raw` (or when the model
/// has no template, with a warning), else the last message's text alone.
pub fn conversation_ids(
    tokenizer: &TextTokenizer,
    template: Option<&ChatTemplate>,
    messages: &[Message],
    raw: bool,
) -> Result<Vec<u32>> {
    let last = || messages.last().map(|m| m.content.as_str()).unwrap_or("");
    match (template, raw) {
        (Some(t), false) => {
            let text = t.render(messages, true)?;
            // The template writes any BOS itself.
            tokenizer.encode(&text, false)
        }
        (None, false) => {
            tracing::warn!("the model has no chat template; using the prompt as raw text");
            tokenizer.encode(last(), true)
        }
        (_, true) => tokenizer.encode(last(), true),
    }
}

/// The current UTC date for templates that print it; supports the usual `%d %b %Y`-style
/// fields (anything else is left as written).
fn strftime_now(fmt: &str) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    let days = secs.div_euclid(86_400);
    // Civil-from-days (proleptic Gregorian).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let name = MONTHS[(month - 1) as usize];
    fmt.replace("%Y", &year.to_string())
        .replace("%m", &format!("{month:02}"))
        .replace("%d", &format!("{day:02}"))
        .replace("%B", name)
        .replace("%b", &name[..3])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_chatml_with_generation_prompt() {
        let src = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
        let t = ChatTemplate::new(src, "", "").unwrap();
        let out = t.render(&[Message::new("user", "hi")], true).unwrap();
        assert_eq!(
            out,
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn raise_exception_and_bad_syntax_are_errors() {
        let t = ChatTemplate::new("{{ raise_exception('no system role') }}", "", "").unwrap();
        let err = t.render(&[], false).unwrap_err();
        assert!(err.to_string().contains("no system role"));
        assert!(ChatTemplate::new("{% for %}", "", "").is_err());
    }

    #[test]
    fn python_string_methods_work() {
        let t = ChatTemplate::new("{{ messages[0].content.strip().upper() }}", "", "").unwrap();
        assert_eq!(
            t.render(&[Message::new("user", "  x ")], false).unwrap(),
            "X"
        );
    }
}
