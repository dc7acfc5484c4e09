//! The front matter's size as a deserializer would see it, aliases resolved: measured
//! before it is read, so a small file cannot expand into a huge one.

use super::NODE_COST;

/// Walks a YAML document the way a deserializer sees it, aliases resolved, and fails as
/// soon as it amounts to more than `budget` (see [`MAX_FRONT_MATTER_EXPANSION`]). Nothing
/// is kept: strings are only measured.
pub fn check_yaml_expansion(yaml: &str, budget: usize) -> std::result::Result<(), String> {
    use serde::de::DeserializeSeed;
    let mut left = budget;
    Expansion {
        left: &mut left,
        budget,
    }
    .deserialize(serde_norway::Deserializer::from_str(yaml))
    .map_err(|e| e.to_string())
}

/// The measuring walk of [`check_yaml_expansion`].
struct Expansion<'a> {
    left: &'a mut usize,
    budget: usize,
}

impl Expansion<'_> {
    fn spend<E: serde::de::Error>(&mut self, bytes: usize) -> std::result::Result<(), E> {
        let cost = bytes.saturating_add(NODE_COST);
        if cost > *self.left {
            return Err(E::custom(format!(
                "the YAML expands to more than {} bytes once its aliases are resolved \
                 (each `*alias` repeats its anchor's whole content)",
                self.budget
            )));
        }
        *self.left -= cost;
        Ok(())
    }

    fn child(&mut self) -> Expansion<'_> {
        Expansion {
            left: &mut *self.left,
            budget: self.budget,
        }
    }
}

impl<'de> serde::de::DeserializeSeed<'de> for Expansion<'_> {
    type Value = ();
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> std::result::Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for Expansion<'_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("any YAML value")
    }

    fn visit_bool<E: serde::de::Error>(mut self, _: bool) -> std::result::Result<(), E> {
        self.spend(0)
    }
    fn visit_i64<E: serde::de::Error>(mut self, _: i64) -> std::result::Result<(), E> {
        self.spend(0)
    }
    fn visit_u64<E: serde::de::Error>(mut self, _: u64) -> std::result::Result<(), E> {
        self.spend(0)
    }
    fn visit_i128<E: serde::de::Error>(mut self, _: i128) -> std::result::Result<(), E> {
        self.spend(0)
    }
    fn visit_u128<E: serde::de::Error>(mut self, _: u128) -> std::result::Result<(), E> {
        self.spend(0)
    }
    fn visit_f64<E: serde::de::Error>(mut self, _: f64) -> std::result::Result<(), E> {
        self.spend(0)
    }
    fn visit_str<E: serde::de::Error>(mut self, v: &str) -> std::result::Result<(), E> {
        self.spend(v.len())
    }
    fn visit_bytes<E: serde::de::Error>(mut self, v: &[u8]) -> std::result::Result<(), E> {
        self.spend(v.len())
    }
    fn visit_none<E: serde::de::Error>(mut self) -> std::result::Result<(), E> {
        self.spend(0)
    }
    fn visit_unit<E: serde::de::Error>(mut self) -> std::result::Result<(), E> {
        self.spend(0)
    }
    fn visit_some<D: serde::Deserializer<'de>>(
        mut self,
        d: D,
    ) -> std::result::Result<(), D::Error> {
        use serde::de::DeserializeSeed;
        self.spend(0)?;
        self.child().deserialize(d)
    }
    fn visit_newtype_struct<D: serde::Deserializer<'de>>(
        mut self,
        d: D,
    ) -> std::result::Result<(), D::Error> {
        use serde::de::DeserializeSeed;
        self.spend(0)?;
        self.child().deserialize(d)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(
        mut self,
        mut seq: A,
    ) -> std::result::Result<(), A::Error> {
        self.spend(0)?;
        while seq.next_element_seed(self.child())?.is_some() {}
        Ok(())
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(
        mut self,
        mut map: A,
    ) -> std::result::Result<(), A::Error> {
        self.spend(0)?;
        while map.next_key_seed(self.child())?.is_some() {
            map.next_value_seed(self.child())?;
        }
        Ok(())
    }
    fn visit_enum<A: serde::de::EnumAccess<'de>>(
        mut self,
        data: A,
    ) -> std::result::Result<(), A::Error> {
        use serde::de::VariantAccess;
        // A tagged node (`!tag value`): the tag, then its value.
        self.spend(0)?;
        let ((), variant) = data.variant_seed(self.child())?;
        variant.newtype_variant_seed(self.child())
    }
}
